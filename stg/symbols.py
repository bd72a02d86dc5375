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
