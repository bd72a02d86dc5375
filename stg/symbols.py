"""Symbols that every model shares, bound from the plan rather than the model.

Model-specific sizes (H, F, A, V, ...) are declared by each model family; these are the
ones the plan decides: the micro-batch and sequence of one step, and how much of a causal
attention score matrix is counted.
"""

import sympy

B = sympy.Symbol("B", positive=True, integer=True)  # micro-batch, summed over data-parallel ranks
S = sympy.Symbol("S", positive=True, integer=True)  # sequence length
# Fraction of each attention score matrix that is computed: 1/2 for causal (masked blocks
# skipped, as FlashAttention does and Megatron-LM's FLOP counter assumes), 1 for full squares.
ATTN_FRACTION = sympy.Symbol("rho", positive=True)

# Serving (stg/serve): one inference step is a batch of requests, request i bringing q_i new
# tokens on top of c_i cached ones. The step's tokens S = sum q_i run as one packed sequence
# (B = 1); attention reads KV_TOKENS = sum (c_i + q_i) cached keys and values and scores
# PAIRS = sum q_i (c_i + q_i) query-key pairs (causal counting: sum q_i c_i + q_i (q_i + 1) / 2);
# SAMPLED of the step's positions (each request's last, when it yields a token) reach the LM head.
KV_TOKENS = sympy.Symbol("Tkv", positive=True, integer=True)
PAIRS = sympy.Symbol("Pqk", positive=True, integer=True)
SAMPLED = sympy.Symbol("Nout", positive=True, integer=True)
