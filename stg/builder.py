"""GraphBuilder: the one way ops enter a graph, with shapes checked and costs derived.

Model builders call the named methods (`einsum`, `pointwise`, `norm`, ...); passes such as
autodiff and redistribution use `add_op` with tensors they have already shaped. Every op's
FLOPs and bytes come from stg/costs.py, never from the caller.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import islice
from operator import attrgetter
from typing import Any, Iterable, Mapping, Sequence

import sympy

from stg.costs import COST_ATTRS, NormKind, Pointwise, op_cost
from stg.errors import GraphError
from stg.graph import DType, Graph, Op, OpKind, Phase, Role, Tensor


@dataclass(frozen=True)
class Block:
    """Ops and tensors built together (a layer), every name they make under `prefix`, and the
    names they read from before them: what GraphBuilder.add_copy repeats."""

    ops: tuple[Op, ...]
    tensors: tuple[Tensor, ...]
    prefix: str
    made: frozenset[str]
    reads: frozenset[str]

    def renaming(self, prefix: str) -> dict[str, str]:
        """Each name the block makes, under `prefix` instead of its own."""
        return {name: prefix + name[len(self.prefix):] for name in self.made}


class GraphBuilder:
    def __init__(self, graph: Graph | None = None, weight_dtype: DType = DType.BF16):
        self.tensors: dict[str, Tensor] = dict(graph.tensors) if graph else {}
        self.ops: list[Op] = list(graph.ops) if graph else []
        self._op_names = {op.name for op in self.ops}
        self.layer = 0
        self.phase = Phase.FORWARD
        self.weight_dtype = weight_dtype  # the model's dtype: its weights, and so its activations

    # -- leaves -------------------------------------------------------------------------------
    def input(self, name: str, shape: Sequence, dims: Sequence[str], dtype: DType = DType.INT64) -> str:
        return self._tensor(Tensor(name, tuple(shape), tuple(dims), dtype, Role.INPUT))

    def weight(self, name: str, shape: Sequence, dims: Sequence[str], dtype: DType | None = None) -> str:
        return self._tensor(Tensor(name, tuple(shape), tuple(dims), dtype or self.weight_dtype, Role.WEIGHT))

    def state(self, name: str, shape: Sequence, dims: Sequence[str], dtype: DType = DType.FP32) -> str:
        return self._tensor(Tensor(name, tuple(shape), tuple(dims), dtype, Role.OPTIMIZER_STATE))

    # -- forward ops --------------------------------------------------------------------------
    def einsum(self, name: str, spec: str, a: str, b: str, *, density: Any = 1, transient: bool = False,
               **attrs) -> str:
        """A contraction written as einsum indices, e.g. `bsh,hf->bsf`. `density` < 1 counts
        only part of the output (causal attention computes half of the score matrix)."""
        ta, tb = self.tensors[a], self.tensors[b]
        letters = _parse_spec(name, spec)
        size: dict[str, sympy.Expr] = {}
        axis: dict[str, str] = {}
        for operand, tensor in zip(letters[:2], (ta, tb)):
            if len(operand) != len(tensor.shape):
                raise GraphError(
                    f"op {name}: einsum operand '{operand}' has {len(operand)} indices but tensor "
                    f"{tensor.name} has shape {list(tensor.shape)}"
                )
            for letter, dim, logical in zip(operand, tensor.shape, tensor.dims):
                if letter in size and sympy.simplify(size[letter] - dim) != 0:
                    raise GraphError(
                        f"op {name}: einsum index '{letter}' is {size[letter]} in one operand but "
                        f"{dim} in {tensor.name} {list(tensor.shape)}"
                    )
                size[letter] = dim
                axis.setdefault(letter, logical)
        out_letters = letters[2]
        unknown = [letter for letter in out_letters if letter not in size]
        if unknown:
            raise GraphError(f"op {name}: output index {unknown} of '{spec}' appears in no operand")
        out = Tensor(
            name,
            tuple(size[c] for c in out_letters),
            tuple(axis[c] for c in out_letters),
            # an fp8 GEMM writes the model's 16-bit dtype
            self.weight_dtype if DType.FP8 in (ta.dtype, tb.dtype) else ta.dtype,
            Role.ACTIVATION,
            transient,
        )
        attrs = {"spec": spec, **attrs}
        if density != 1:
            attrs["density"] = sympy.sympify(density)
        self.add_op(name, OpKind.EINSUM, (a, b), (out,), attrs)
        return name

    def pointwise(self, name: str, fn: Pointwise, *inputs: str) -> str:
        """Elementwise op; later inputs broadcast to the first by logical axis names."""
        first = self.tensors[inputs[0]]
        for other in inputs[1:]:
            _check_broadcast(name, first, self.tensors[other])
        out = Tensor(name, first.shape, first.dims, first.dtype, Role.ACTIVATION, first.transient)
        self.add_op(name, OpKind.POINTWISE, inputs, (out,), {"fn": fn})
        return name

    def cast(self, name: str, x: str, dtype: DType) -> str:
        """x in another dtype (Transformer Engine's fp8 copy of a linear layer's input)."""
        src = self.tensors[x]
        out = Tensor(name, src.shape, src.dims, dtype, Role.ACTIVATION, src.transient)
        self.add_op(name, OpKind.POINTWISE, (x,), (out,), {"fn": Pointwise.CAST})
        return name

    def _masked(self, x: str, attrs: dict) -> dict:
        """An op on a partly computed (causal) score matrix does that part of its work too."""
        producer = next((op for op in reversed(self.ops) if x in op.outputs), None)
        if producer is not None and "density" in producer.attrs:
            return {**attrs, "density": producer.attrs["density"]}
        return attrs

    def attention(self, name: str, q: str, new: Sequence[str], caches: Sequence[str], pairs, out_dim=None,
                  out_axis: str | None = None) -> str:
        """Fused attention of the step's queries q [batch, tokens, .., heads, d] over a KV cache
        `caches` [batch, kv_tokens, .., d] (keys and values, or one latent both read) that
        already holds the step's `new` entries; `pairs` is the number of query-key pairs scored
        per batch entry (ragged over the requests packed in it). The output is q's shape, or
        with `out_dim` its last dimension that size (logical axis `out_axis`)."""
        src = self.tensors[q]
        for cache in caches:
            t = self.tensors[cache]
            if t.dims[1] != "kv_tokens" or sympy.simplify(t.shape[-1] - src.shape[-1]) != 0:
                raise GraphError(f"op {name}: cache {t.name} {list(t.shape)} axes {list(t.dims)} is not "
                                 f"[batch, kv_tokens, .., d] matching {src.name} {list(src.shape)}")
        shape, dims = src.shape, src.dims
        if out_dim is not None:
            shape, dims = shape[:-1] + (sympy.sympify(out_dim),), dims[:-1] + (out_axis,)
        out = Tensor(name, shape, dims, src.dtype, Role.ACTIVATION)
        self.add_op(name, OpKind.ATTENTION, (q, *new, *caches), (out,),
                    {"pairs": sympy.sympify(pairs), "new": len(new)})
        return name

    def softmax(self, name: str, x: str, **attrs) -> str:
        attrs = self._masked(x, attrs)
        src = self.tensors[x]
        out = Tensor(name, src.shape, src.dims, src.dtype, Role.ACTIVATION, src.transient)
        self.add_op(name, OpKind.SOFTMAX, (x,), (out,), attrs)
        return name

    def norm(self, name: str, norm: NormKind, x: str, weight: str, bias: str | None = None) -> str:
        src = self.tensors[x]
        for param in (weight, bias):
            if param is not None:
                _check_broadcast(name, src, self.tensors[param])
        inputs = (x, weight) if bias is None else (x, weight, bias)
        out = Tensor(name, src.shape, src.dims, src.dtype, Role.ACTIVATION)
        self.add_op(name, OpKind.NORM, inputs, (out,), {"norm": norm})
        return name

    def embedding(self, name: str, table: str, ids: str) -> str:
        """Rows of `table` [rows, dim] looked up by integer `ids`: output is ids.shape + [dim]."""
        t, i = self.tensors[table], self.tensors[ids]
        out = Tensor(name, i.shape + t.shape[1:], i.dims + t.dims[1:], t.dtype, Role.ACTIVATION)
        self.add_op(name, OpKind.EMBEDDING, (table, ids), (out,))
        return name

    def embedding_bag(self, name: str, table: str, ids: str, lengths: str, **attrs) -> str:
        """Tables stacked by rows, `table` [rows, dim], looked up by `ids` [batch, ids] and
        sum-pooled per feature, `lengths` [batch, features] ids each (TorchRec's jagged
        KeyedJaggedTensor): output [batch, features, dim]. `attrs` say how the backward
        updates the table (`update`: "fused" or "dense", `fn`: the optimizer)."""
        t, n = self.tensors[table], self.tensors[lengths]
        out = Tensor(name, n.shape + t.shape[-1:], n.dims + t.dims[-1:], t.dtype, Role.ACTIVATION)
        self.add_op(name, OpKind.EMBEDDING_BAG, (table, ids, lengths), (out,), attrs)
        return name

    def concat(self, name: str, inputs: Sequence[str], shape: Sequence, dims: Sequence[str], dim: int) -> str:
        """`inputs` side by side along output dimension `dim`; the output is `shape` with
        logical axes `dims`. An input dimension whose axis the output shares must match it
        in size; an input's other dimensions are what it contributes along `dim` (its real
        part, when an input is padded or holds column shards)."""
        out = Tensor(name, tuple(shape), tuple(dims), self.tensors[inputs[0]].dtype, Role.ACTIVATION)
        for x in inputs:
            t = self.tensors[x]
            for logical, size in zip(t.dims, t.shape):
                if logical in out.dims and logical != out.dims[dim] and sympy.simplify(
                        out.shape[out.dims.index(logical)] - size) != 0:
                    raise GraphError(f"op {name}: {t.name} {list(t.shape)} axis {logical!r} does not match "
                                     f"the output {list(out.shape)} axes {list(out.dims)}")
        self.add_op(name, OpKind.CONCAT, tuple(inputs), (out,), {"dim": dim})
        return name

    def gather(self, name: str, x: str, shape: Sequence, dims: Sequence[str], **attrs) -> str:
        """A fixed selection of `x`'s elements, shaped `shape` (e.g. a lower triangle)."""
        src = self.tensors[x]
        out = Tensor(name, tuple(shape), tuple(dims), src.dtype, Role.ACTIVATION)
        self.add_op(name, OpKind.GATHER, (x,), (out,), attrs)
        return name

    def dropout(self, name: str, x: str, **attrs) -> str:
        """Dropout; its 1-byte mask is an output because the backward reads it."""
        attrs = self._masked(x, attrs)
        src = self.tensors[x]
        out = Tensor(name, src.shape, src.dims, src.dtype, Role.ACTIVATION, src.transient)
        mask = Tensor(f"{name}.mask", src.shape, src.dims, DType.UINT8, Role.ACTIVATION, src.transient)
        self.add_op(name, OpKind.DROPOUT, (x,), (out, mask), attrs)
        return name

    def route(self, name: str, logits: str, top_k: int) -> str:
        """Router: probabilities over the experts, all but each token's top k zeroed."""
        src = self.tensors[logits]
        out = Tensor(name, src.shape, src.dims, src.dtype, Role.ACTIVATION)
        self.add_op(name, OpKind.ROUTE, (logits,), (out,), {"top_k": top_k})
        return name

    def dispatch(self, name: str, x: str, gates: str, capacity: Any) -> str:
        """Tokens x [..., embed] into per-expert buffers [expert, capacity, embed]."""
        tokens, g = self.tensors[x], self.tensors[gates]
        out = Tensor(name, (g.shape[-1], sympy.sympify(capacity), tokens.shape[-1]),
                     (g.dims[-1], "capacity", tokens.dims[-1]), tokens.dtype, Role.ACTIVATION)
        self.add_op(name, OpKind.DISPATCH, (x, gates), (out,))
        return name

    def combine(self, name: str, buffers: str, gates: str) -> str:
        """Expert outputs [expert, capacity, embed] back to the tokens, weighted by the gates."""
        buf, g = self.tensors[buffers], self.tensors[gates]
        out = Tensor(name, g.shape[:-1] + buf.shape[-1:], g.dims[:-1] + buf.dims[-1:], buf.dtype, Role.ACTIVATION)
        self.add_op(name, OpKind.COMBINE, (buffers, gates), (out,))
        return name

    def constrain(self, name: str, x: str, tag: str, **attrs) -> str:
        """Anchor `x` to the layout the plan gives `tag` (e.g. 'residual'); no cost, no node."""
        src = self.tensors[x]
        out = Tensor(name, src.shape, src.dims, src.dtype, src.role, src.transient)
        self.add_op(name, OpKind.CONSTRAIN, (x,), (out,), {"tag": tag, **attrs})
        return name

    def cross_entropy(self, name: str, logits: str, labels: str) -> str:
        """Mean token loss in two ops: per-token statistics (max, sum of exp, target logit),
        which a vocabulary split leaves as partial sums, then the loss from them."""
        src = self.tensors[logits]
        stats = Tensor(f"{name}.stats", src.shape[:-1] + (3,), src.dims[:-1] + ("loss_stats",), DType.FP32,
                       Role.ACTIVATION)
        self.add_op(stats.name, OpKind.CROSS_ENTROPY, (logits, labels), (stats,))
        self.add_op(name, OpKind.LOSS, (stats.name,), (Tensor(name, (), (), DType.FP32, Role.ACTIVATION),))
        return name

    # -- the general entry point --------------------------------------------------------------
    def add_op(
        self,
        name: str,
        kind: OpKind,
        inputs: Sequence[str],
        outputs: Sequence[Tensor],
        attrs: dict | None = None,
        *,
        phase: Phase | None = None,
        layer: int | None = None,
    ) -> Op:
        if name in self._op_names:
            raise GraphError(f"op {name}: name used twice")
        missing = [i for i in inputs if i not in self.tensors]
        if missing:
            raise GraphError(f"op {name}: unknown input tensor(s) {missing}")
        for out in outputs:
            self._tensor(out)
        attrs = attrs or {}
        flops, nbytes = _cost(kind, attrs, [self.tensors[i] for i in inputs], outputs)
        op = Op(
            name,
            kind,
            tuple(inputs),
            tuple(o.name for o in outputs),
            flops,
            nbytes,
            phase or self.phase,
            self.layer if layer is None else layer,
            attrs,
        )
        self.ops.append(op)
        self._op_names.add(name)
        return op

    def named(self, name: str) -> bool:
        """Whether a tensor or an op has this name."""
        return name in self.tensors or name in self._op_names

    def add_costed(self, ops: Sequence[Op], outputs: Iterable[tuple[str, Tensor]]) -> None:
        """Ops whose costs are known (a repeated block's copies of ops already derived), and
        their outputs by name, registered as they are: no checks, no sympy."""
        self.tensors.update(outputs)
        self.ops.extend(ops)
        self._op_names.update(map(attrgetter("name"), ops))

    def mark(self) -> tuple[int, int]:
        """How many ops and tensors the graph has: what is added after a mark is a block."""
        return len(self.ops), len(self.tensors)

    def block(self, mark: tuple[int, int], prefix: str) -> Block | None:
        """The ops and tensors added since `mark`, when every name they make is under
        `prefix` (its copies swap that prefix); None otherwise."""
        ops, tensors = tuple(self.ops[mark[0]:]), tuple(islice(self.tensors.values(), mark[1], None))
        made = frozenset(t.name for t in tensors) | frozenset(op.name for op in ops)
        if any(not name.startswith(prefix + ".") for name in made):
            return None
        return Block(ops, tensors, prefix, made, frozenset(i for op in ops for i in op.inputs if i not in made))

    def add_copy(self, block: Block, rename: Mapping[str, str], layer: int) -> None:
        """`block` again, each name it makes and reads mapped by `rename`, in `layer`: the
        copies of a repeated layer are made without checks and without sympy, tensors and ops
        in the order building them makes them."""
        for tensor in block.tensors:
            self.tensors[rename[tensor.name]] = tensor.renamed(rename[tensor.name])
        for op in block.ops:
            self.ops.append(op.renamed(rename[op.name], tuple(rename[i] for i in op.inputs),
                                       tuple(rename[o] for o in op.outputs), layer, dict(op.attrs)))
            self._op_names.add(rename[op.name])

    def build(self) -> Graph:
        return Graph(dict(self.tensors), tuple(self.ops))

    def _tensor(self, tensor: Tensor) -> str:
        if tensor.name in self.tensors:
            raise GraphError(f"tensor {tensor.name}: defined twice")
        for dim in tensor.shape:
            if dim.is_number and dim <= 0:
                raise GraphError(f"tensor {tensor.name}: dimension {dim} is not positive")
        self.tensors[tensor.name] = tensor
        return tensor.name


_COSTS: dict[tuple, tuple[sympy.Expr, sympy.Expr]] = {}


def _cost(kind: OpKind, attrs: dict, inputs: Sequence[Tensor], outputs: Sequence[Tensor]):
    """op_cost, expanded; memoised on what it reads (not the names of tensors or of the ops
    a gradient belongs to), so the copies of a repeated block -- and of its differentiated
    and sharded forms -- cost one sympy derivation."""
    try:
        key = (kind, tuple(attrs.get(name) for name in COST_ATTRS),
               tuple((t.shape, t.dims, t.dtype, t.role, t.transient) for t in (*inputs, *outputs)), len(inputs))
        hash(key)
    except TypeError:  # an attribute that cannot be a key: derive it afresh
        key = None
    if key is not None and key in _COSTS:
        return _COSTS[key]
    flops, nbytes = op_cost(kind, attrs, inputs, outputs)
    result = _expanded(flops), _expanded(nbytes)
    if key is not None:
        if len(_COSTS) > 1 << 16:
            _COSTS.clear()
        _COSTS[key] = result
    return result


def _expanded(expr: sympy.Expr) -> sympy.Expr:
    """sympy.expand(expr); a product of numbers and powers of symbols (most costs: a matmul's
    2 B S H F / tp) is its own expansion, which sympy would take a walk of its terms to find."""
    if expr.is_Mul and all(arg.is_Symbol or arg.is_Rational or arg.is_Pow and arg.base.is_Symbol and arg.exp.is_Integer
                           for arg in expr.args) or expr.is_Symbol or expr.is_Rational:
        return expr
    return sympy.expand(expr)


def _parse_spec(name: str, spec: str) -> tuple[str, str, str]:
    try:
        lhs, out = spec.replace(" ", "").split("->")
        a, b = lhs.split(",")
    except ValueError:
        raise GraphError(f"op {name}: einsum spec {spec!r} is not of the form 'ab,bc->ac'") from None
    return a, b, out


def _check_broadcast(name: str, target: Tensor, operand: Tensor) -> None:
    """`operand` broadcasts to `target` when its axes are a subset of target's, sizes equal."""
    if operand.dims == target.dims and all(sympy.simplify(a - b) == 0 for a, b in zip(operand.shape, target.shape)):
        return  # the same axes (also when an axis name repeats, as in seq x seq scores)
    for logical, dim in zip(operand.dims, operand.shape):
        matches = [d for ax, d in zip(target.dims, target.shape) if ax == logical]
        if len(matches) != 1 or sympy.simplify(matches[0] - dim) != 0:
            raise GraphError(
                f"op {name}: {operand.name} {list(operand.shape)} axes {list(operand.dims)} do not "
                f"broadcast to {target.name} {list(target.shape)} axes {list(target.dims)}"
            )


def broadcast_dims(target: Tensor, operand: Tensor) -> list[int]:
    """Positions in `target` that `operand` lacks (those a broadcast gradient sums over)."""
    return [i for i, ax in enumerate(target.dims) if ax not in operand.dims]
