"""FLOPs and bytes of every op kind, derived from the shapes of its tensors.

One function, `op_cost`, serves the global graph and every sharded graph: a strategy changes
the (local) shapes, and the costs follow. FLOPs are floating-point operations (a multiply-add
is 2). Bytes are the memory traffic of a straightforward kernel: every input read once and
every output written once, transient (on-chip) tensors excluded; the exceptions say why.

Per-element FLOP counts of the non-contraction ops are conventional operation counts, stated
next to each entry; they are small next to the contractions of any real model.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Mapping, Sequence

import sympy

from stg.graph import OpKind, Tensor


class Pointwise(Enum):
    """Elementwise functions: (FLOPs per output element forward, backward, whether the
    backward reads the forward inputs -- what decides if they are saved)."""

    ADD = ("add", 1, 0, False)  # the gradient passes through unchanged: no backward op
    GELU = ("gelu", 8, 13, True)  # tanh form: x^3, 3 mul, add, tanh, add, mul
    SILU = ("silu", 4, 8, True)  # x*sigmoid(x): exp, add, div, mul
    SWIGLU = ("swiglu", 5, 10, True)  # silu(gate) * up, one fused kernel with two inputs
    ROPE = ("rope", 3, 3, False)  # a rotation: linear, so its backward rotates back, no inputs
    DROPOUT = ("dropout", 2, 1, False)  # draw and scale; backward multiplies by the saved mask
    RELU = ("relu", 1, 1, True)  # max(x, 0); backward masks by x > 0
    MUL = ("mul", 1, 2, True)  # a * b; backward: dout * b and dout * a
    # a dtype cast (to fp8: scale and round); the gradient passes through, no backward op
    CAST = ("cast", 1, 0, False)

    def __init__(self, label: str, forward_flops: int, backward_flops: int, reads_input: bool):
        self.label = label
        self.forward_flops = forward_flops
        self.backward_flops = backward_flops
        self.reads_input = reads_input


class NormKind(Enum):
    """Normalisations: (FLOPs per element forward, input-gradient backward)."""

    # per element, reductions one op each (derived in tests/test_flop_constants.py)
    LAYER_NORM = ("layernorm", 7, 16)  # mean, sub, square, variance, rsqrt-mul, scale, shift
    RMS_NORM = ("rmsnorm", 4, 8)  # square, mean, rsqrt-mul, scale

    def __init__(self, label: str, forward_flops: int, backward_flops: int):
        self.label = label
        self.forward_flops = forward_flops
        self.backward_flops = backward_flops


LOSS_FLOPS = 3  # per token: log(sum of exp) + max - target logit
SOFTMAX_FLOPS = 5  # max, subtract, exp, sum, divide
SOFTMAX_GRAD_FLOPS = 4  # y * (dy - sum(dy * y)): mul, sum, sub, mul
CROSS_ENTROPY_FLOPS = 5  # a softmax over the vocabulary, then log and pick the label
CROSS_ENTROPY_GRAD_FLOPS = 3  # softmax recomputed from saved max/sum, minus one-hot, scale
REDUCE_FLOPS = 1  # one add per input element
ROUTE_FLOPS = 6  # softmax over the experts (5) and a top-k comparison (1) per router logit
ROUTE_GRAD_FLOPS = 4  # softmax backward
EMBEDDING_GRAD_FLOPS = 1  # scatter-add: one add per gradient element
EMBEDDING_BAG_FLOPS = 1  # sum pooling: one add per looked-up element


class Optimizer(Enum):
    """Optimizers: (FLOPs per parameter, FLOPs per row, whether the states are one value per
    row rather than one per parameter, the states' names; a `master` state is the fp32 copy of
    a low-precision weight, absent for an fp32 one)."""

    # AdamW per parameter: m = b1*m + (1-b1)*g (3), v = b2*v + (1-b2)*g^2 (4), bias
    # corrections m/c1, v/c2 (2), sqrt, +eps, divide (3), decay p*(1-lr*wd) (1), p -= lr*u (2).
    # States: fp32 master weights and both moments (Micikevicius et al. 2018; ZeRO's K = 12).
    ADAMW = ("adamw", 15, 0, False, ("master", "exp_avg", "exp_avg_sq"))
    # Row-wise Adagrad (FBGEMM's EXACT_ROWWISE_ADAGRAD, TorchRec's and MLPerf DLRM's choice for
    # embeddings): per parameter g^2 and its sum (2), p -= multiplier * g (2); per row the
    # mean, s += mean, multiplier = lr / (sqrt(s) + eps) (5). One fp32 state per row.
    ROWWISE_ADAGRAD = ("rowwise_adagrad", 4, 5, True, ("sum_sq",))
    # Adagrad (Duchi et al. 2011; MLPerf DLRM-DCNv2's dense optimizer; torch.optim.Adagrad):
    # s += g^2 (2), p -= lr * g / (sqrt(s) + eps) (5). One state per parameter (and the fp32
    # master copy of a low-precision weight).
    ADAGRAD = ("adagrad", 7, 0, False, ("master", "sum_sq"))

    def __init__(self, label: str, flops: int, row_flops: int, per_row: bool, states: tuple[str, ...]):
        self.label = label
        self.flops = flops
        self.row_flops = row_flops
        self.per_row = per_row
        self.states = states

    def step_flops(self, weight: Tensor) -> sympy.Expr:
        return self.flops * weight.numel + self.row_flops * weight.shape[0]


def _memory(tensors: Sequence[Tensor]) -> sympy.Expr:
    return sympy.Add(*(t.memory_bytes for t in tensors))


def einsum_sizes(spec: str, inputs: Sequence[Tensor]) -> dict[str, sympy.Expr]:
    """Size of every index letter of an einsum `ab,bc->ac` (operands already checked)."""
    operands = spec.split("->")[0].split(",")
    sizes: dict[str, sympy.Expr] = {}
    for letters, tensor in zip(operands, inputs):
        sizes.update(zip(letters, tensor.shape))
    return sizes


# The attributes op_cost reads; a cost is a function of these, the op kind and the tensors'
# shapes, dtypes and roles (stg/builder.py memoises it on exactly that).
COST_ATTRS = ("density", "fn", "new", "norm", "pairs", "spec")


def op_cost(
    kind: OpKind, attrs: Mapping[str, Any], inputs: Sequence[Tensor], outputs: Sequence[Tensor]
) -> tuple[sympy.Expr, sympy.Expr]:
    """(FLOPs, bytes) of one op from its tensors' shapes."""
    traffic = _memory(inputs) + _memory(outputs)
    # causal attention computes part of each score matrix (`density` < 1): the contractions
    # that make or read it skip the masked blocks, and so do the softmax and dropout on it
    density = attrs.get("density", 1)
    out_numel = sympy.Add(*(t.numel for t in outputs))
    if kind is OpKind.EINSUM:
        # 2 x the product of all index sizes
        product = sympy.Mul(*einsum_sizes(attrs["spec"], inputs).values())
        return 2 * product * density, traffic
    if kind is OpKind.POINTWISE:
        return attrs["fn"].forward_flops * outputs[0].numel, traffic
    if kind is OpKind.POINTWISE_GRAD:
        return attrs["fn"].backward_flops * inputs[0].numel * density, traffic
    if kind is OpKind.SOFTMAX:
        return SOFTMAX_FLOPS * outputs[0].numel * density, traffic
    if kind is OpKind.SOFTMAX_GRAD:
        return SOFTMAX_GRAD_FLOPS * outputs[0].numel * density, traffic
    if kind is OpKind.NORM:
        return attrs["norm"].forward_flops * outputs[0].numel, traffic
    if kind is OpKind.NORM_GRAD:
        return attrs["norm"].backward_flops * outputs[0].numel, traffic
    if kind is OpKind.REDUCE:
        # one add per element; with two inputs (a norm weight's gradient) a multiply first
        return REDUCE_FLOPS * len(inputs) * inputs[0].numel, traffic
    if kind is OpKind.EMBEDDING:
        # reads only the looked-up rows (as many as output elements), not the whole table
        ids, out = inputs[1], outputs[0]
        return sympy.Integer(0), ids.memory_bytes + 2 * out.memory_bytes
    if kind is OpKind.EMBEDDING_GRAD:
        # reads the gradient and ids, read-modify-writes the touched rows of the table gradient
        grad, ids = inputs
        return EMBEDDING_GRAD_FLOPS * grad.numel, ids.memory_bytes + 3 * grad.memory_bytes
    if kind is OpKind.EMBEDDING_BAG:
        # every id reads one row of the table and adds it into its sample's pooled vector:
        # bytes = the ids and lengths, the rows touched x dim, the pooled output
        table, ids, _ = inputs
        touched = ids.numel * table.shape[-1]
        return EMBEDDING_BAG_FLOPS * touched, _memory(inputs[1:]) + touched * table.dtype.nbytes + _memory(outputs)
    if kind is OpKind.EMBEDDING_BAG_GRAD:
        # every id scatter-adds its sample's pooled gradient into its row (read-modify-write)
        ids = inputs[1]
        touched = ids.numel * outputs[0].shape[-1]
        return EMBEDDING_GRAD_FLOPS * touched, _memory(inputs) + 2 * touched * outputs[0].dtype.nbytes
    if kind is OpKind.EMBEDDING_BAG_UPDATE:
        # FBGEMM's fused backward: per id, its sample's pooled gradient is read and added into
        # its row's gradient; per touched row, the row and its states are read and written and
        # the optimizer runs. Touched rows: at most one per id and at most the table's rows
        # (which rows repeat depends on the data; no distribution is assumed).
        dpooled, ids, lengths, table, *states = inputs
        dim = table.shape[-1]
        touched = sympy.Min(ids.numel, table.shape[0])
        row_bytes = dim * table.dtype.nbytes + sum(t.dtype.nbytes for t in states)
        fn = attrs["fn"]
        flops = EMBEDDING_GRAD_FLOPS * ids.numel * dim + touched * (fn.flops * dim + fn.row_flops)
        return flops, _memory((ids, lengths)) + ids.numel * dim * dpooled.dtype.nbytes + 2 * touched * row_bytes
    if kind in (OpKind.CONCAT, OpKind.CONCAT_GRAD, OpKind.GATHER):
        # a copy: what is written is read once (padded inputs contribute only their real part)
        written = _memory(outputs) if kind is not OpKind.CONCAT_GRAD else inputs[0].memory_bytes
        return sympy.Integer(0), 2 * written
    if kind is OpKind.GATHER_GRAD:
        # the selected gradient read, the whole input gradient written (zeros elsewhere)
        return sympy.Integer(0), traffic
    if kind is OpKind.CROSS_ENTROPY:
        return CROSS_ENTROPY_FLOPS * inputs[0].numel, traffic
    if kind is OpKind.LOSS:
        return LOSS_FLOPS * inputs[0].numel / inputs[0].shape[-1], traffic
    if kind is OpKind.DROPOUT:
        return Pointwise.DROPOUT.forward_flops * inputs[0].numel * density, traffic
    if kind is OpKind.CROSS_ENTROPY_GRAD:
        return CROSS_ENTROPY_GRAD_FLOPS * out_numel, traffic
    if kind is OpKind.ROUTE:
        return ROUTE_FLOPS * inputs[0].numel, traffic
    if kind is OpKind.ROUTE_GRAD:
        return ROUTE_GRAD_FLOPS * outputs[0].numel, traffic
    if kind in (OpKind.DISPATCH, OpKind.DISPATCH_GRAD):
        # a permutation: every routed token row is copied once into (or out of) a buffer
        return sympy.Integer(0), traffic
    if kind is OpKind.COMBINE:
        # each token sums its k expert outputs weighted by its gates: a multiply-add per
        # buffer element
        return 2 * inputs[0].numel, traffic
    if kind is OpKind.COMBINE_GRAD:
        # the gradient scattered back to the buffers (a multiply per element) and the gates'
        # gradient (a multiply-add per element)
        return 3 * inputs[2].numel, traffic
    if kind is OpKind.ATTENTION:
        # q [batch, tokens, heads.., d], the new entries, the cache [batch, kv_tokens, .., d]
        # (after the append); per query-key pair and head a score (2 d), a softmax entry and a
        # context multiply-add per output element (2 d_out); the scores stay on chip. Bytes: q,
        # the whole cache and the output, plus the new entries read and written into the cache.
        q, out, new = inputs[0], outputs[0], inputs[1:1 + attrs["new"]]
        heads = sympy.Mul(*q.shape[2:-1])
        per_pair = 2 * sympy.Mul(*q.shape[2:]) + 2 * sympy.Mul(*out.shape[2:]) + SOFTMAX_FLOPS * heads
        return q.shape[0] * attrs["pairs"] * per_pair, traffic + _memory(new)
    if kind is OpKind.OPTIMIZER:
        # inputs: gradient and states, all read; output: the new weight. The states are
        # updated in place, so they are written back as well.
        return attrs["fn"].step_flops(outputs[0]), traffic + _memory(inputs[1:])
    if kind is OpKind.COLLECTIVE:
        # a collective moves its (local) input; see stg/redistribute.py for comm_size semantics
        return sympy.Integer(0), inputs[0].nbytes
    if kind in (OpKind.SLICE, OpKind.CONSTRAIN):
        return sympy.Integer(0), sympy.Integer(0)
    raise AssertionError(f"no cost rule for {kind}")
