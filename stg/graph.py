"""The IR: tensors with symbolic shapes, ops whose FLOPs and bytes derive from those shapes.

A Graph is an immutable list of ops in program (topological) order over a table of tensors.
`print(graph)` shows one op a line, fx-style; `graph.verify()` checks the invariants every
pass relies on. Ops are built by `GraphBuilder` (stg/builder.py), which derives their costs
from the shapes with the rules in stg/costs.py, so a graph never holds a hand-typed FLOP count.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property, lru_cache
from typing import Any, Iterator, Mapping

import sympy

from stg.errors import GraphError

_set_attr = object.__setattr__  # (frozen dataclasses: their copies are made without __init__)


class FastEnum(Enum):
    """An Enum hashed in C by identity (equality is identity already): Enum's own __hash__ is
    a Python call, and these members key the passes' and the lowering's hottest dicts."""

    __hash__ = object.__hash__


class DType(FastEnum):
    BF16 = ("bf16", 2)
    FP16 = ("fp16", 2)
    FP32 = ("fp32", 4)
    FP8 = ("fp8", 1)  # E4M3/E5M2 (Transformer Engine's linear-layer GEMM operands)
    UINT8 = ("uint8", 1)  # dropout masks
    INT32 = ("int32", 4)
    INT64 = ("int64", 8)

    def __init__(self, label: str, nbytes: int):
        self.label = label
        self.nbytes = nbytes

    @classmethod
    def parse(cls, text: str) -> "DType":
        for member in cls:
            if member.label == text:
                return member
        raise ValueError(f"unknown dtype {text!r}; expected one of {[m.label for m in cls]}")


class Role(FastEnum):
    INPUT = "input"  # data fed to the step: token ids, labels
    WEIGHT = "weight"
    ACTIVATION = "activation"
    GRADIENT = "gradient"
    OPTIMIZER_STATE = "optimizer_state"


class OpKind(FastEnum):
    EINSUM = "einsum"
    POINTWISE = "pointwise"
    POINTWISE_GRAD = "pointwise_grad"
    REDUCE = "reduce"  # sum over the dimensions the output lacks (bias and norm-weight gradients)
    SOFTMAX = "softmax"
    SOFTMAX_GRAD = "softmax_grad"
    NORM = "norm"
    NORM_GRAD = "norm_grad"
    EMBEDDING = "embedding"
    EMBEDDING_GRAD = "embedding_grad"
    # a batch of embedding tables looked up and sum-pooled by one kernel (FBGEMM's
    # table-batched embedding, what TorchRec runs): ids [batch, ids] -> [batch, features, dim]
    EMBEDDING_BAG = "embedding_bag"
    EMBEDDING_BAG_GRAD = "embedding_bag_grad"  # the dense table gradient: touched rows scatter-added
    # the backward fused with the optimizer (TorchRec's fused kernel): the touched rows are
    # updated in place and no table gradient is ever made
    EMBEDDING_BAG_UPDATE = "embedding_bag_update"
    CONCAT = "concat"  # inputs side by side along one dimension
    CONCAT_GRAD = "concat_grad"  # the gradient split back to the inputs
    GATHER = "gather"  # a fixed selection of elements (the interaction's lower triangle)
    GATHER_GRAD = "gather_grad"  # scattered back into zeros
    DROPOUT = "dropout"  # outputs the kept values and the mask the backward reads
    CROSS_ENTROPY = "cross_entropy"  # per-token statistics (max, sum of exp, target logit)
    CROSS_ENTROPY_GRAD = "cross_entropy_grad"
    LOSS = "loss"  # mean loss from the per-token statistics
    ROUTE = "route"  # router probabilities and top-k gates over the experts
    ROUTE_GRAD = "route_grad"
    DISPATCH = "dispatch"  # tokens [.., embed] -> expert buffers [expert, capacity, embed]
    DISPATCH_GRAD = "dispatch_grad"
    COMBINE = "combine"  # expert buffers back to tokens, weighted by the gates
    COMBINE_GRAD = "combine_grad"
    OPTIMIZER = "optimizer"
    # Inference: one fused kernel (FlashAttention / vLLM's paged attention) over a KV cache:
    # the step's queries attend to their request's cached keys and values plus their own.
    # The score pairs are ragged (each request its own q x (c + q)), so their count is a
    # symbol in attrs["pairs"]; the cache inputs hold the keys and values after the append.
    ATTENTION = "attention"
    COLLECTIVE = "collective"
    SLICE = "slice"  # a replicated tensor viewed as one rank's shard: no traffic, no node
    # A layout anchor (JAX's with_sharding_constraint): the tensor must have the layout its
    # tag's rules give (the residual stream, stored gradients, stored parameters). No node.
    CONSTRAIN = "constrain"


VIEWS = (OpKind.SLICE, OpKind.CONSTRAIN)  # ops that make no node: their output is their input


class Phase(FastEnum):
    """When an op runs in a training step; the letters are the pipeline-schedule vocabulary."""

    FORWARD = "F"
    BACKWARD_INPUT = "B"
    BACKWARD_WEIGHT = "W"
    STEP = "S"  # once per step, after the last micro-batch: gradient sync and optimizer


@dataclass(frozen=True)
class Tensor:
    """A tensor of one micro-batch. `dims` names the logical axis of every dimension.

    `transient` tensors live on chip inside a fused kernel (FlashAttention's scores and
    probabilities): they cost FLOPs but no memory traffic and no memory.
    """

    name: str
    shape: tuple[sympy.Expr, ...]
    dims: tuple[str, ...]
    dtype: DType
    role: Role
    transient: bool = False

    def __post_init__(self):
        if len(self.shape) != len(self.dims):
            raise GraphError(
                f"tensor {self.name}: shape {list(self.shape)} has {len(self.shape)} dimensions "
                f"but {len(self.dims)} logical axis names {list(self.dims)}"
            )
        if type(self.shape) is not tuple or not all(isinstance(d, sympy.Basic) for d in self.shape):  # sympify is slow
            object.__setattr__(self, "shape", tuple(sympy.sympify(d) for d in self.shape))

    @cached_property
    def numel(self) -> sympy.Expr:
        return _size(self.shape, 1)

    @property
    def signature(self) -> tuple:
        """Everything but the name."""
        return self.shape, self.dims, self.dtype, self.role, self.transient

    def renamed(self, name: str) -> "Tensor":
        """This tensor under another name, without re-checking its shape (and with its sizes,
        if computed): the copies of a repeated block make thousands."""
        fields = self.__dict__.copy()
        fields["name"] = name
        copy = object.__new__(Tensor)
        _set_attr(copy, "__dict__", fields)  # (a copied dict is set faster than one filled)
        return copy

    @cached_property
    def nbytes(self) -> sympy.Expr:
        return _size(self.shape, self.dtype.nbytes)

    @property
    def memory_bytes(self) -> sympy.Expr:
        return sympy.Integer(0) if self.transient else self.nbytes

    def __str__(self) -> str:
        return f"[{', '.join(map(str, self.shape))}] {self.dtype.label}"


@lru_cache(maxsize=1 << 14)  # the sharded copies of a block's tensors share their shapes
def _size(shape: tuple[sympy.Expr, ...], itemsize) -> sympy.Expr:
    return sympy.Mul(*shape) * itemsize


@dataclass(frozen=True)
class Op:
    """One operation. `layer` is its block in the model's sequence (0 = embeddings,
    1..L = repeated blocks, L+1 = output head and loss), what pipeline stages split on."""

    name: str
    kind: OpKind
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    flops: sympy.Expr
    bytes: sympy.Expr
    phase: Phase
    layer: int
    attrs: Mapping[str, Any] = field(default_factory=dict)

    def renamed(self, name: str, inputs: tuple[str, ...], outputs: tuple[str, ...], layer: int,
                attrs: Mapping[str, Any]) -> "Op":
        """This op (kind, costs, phase) under other names, without the dataclass's __init__: the
        copies of a repeated block make thousands."""
        fields = self.__dict__.copy()
        fields.update(name=name, inputs=inputs, outputs=outputs, layer=layer, attrs=attrs)
        copy = object.__new__(Op)
        _set_attr(copy, "__dict__", fields)
        return copy

    def changed(self, **fields) -> "Op":
        """This op with other `fields`, without the dataclass's __init__ (as renamed)."""
        copy = object.__new__(Op)
        copy.__dict__.update(self.__dict__, **fields)
        return copy

    def label(self) -> str:
        """The op's printed head, e.g. `einsum[bsh,hf->bsf]`."""
        detail = self.attrs.get("spec") or self.attrs.get("fn") or self.attrs.get("norm") or self.attrs.get("tag")
        detail = getattr(detail, "label", detail)
        return self.kind.value if detail is None else f"{self.kind.value}[{detail}]"


@dataclass(frozen=True)
class Graph:
    tensors: Mapping[str, Tensor]
    ops: tuple[Op, ...]

    @cached_property
    def producer(self) -> Mapping[str, Op]:
        return {out: op for op in self.ops for out in op.outputs}

    @cached_property
    def consumers(self) -> Mapping[str, tuple[Op, ...]]:
        users: dict[str, list[Op]] = {}
        found = users.get
        for op in self.ops:  # (tens of thousands: each input's list found once, no list made per call)
            inputs = op.inputs
            if len(inputs) > 1 and len(set(inputs)) < len(inputs):
                inputs = dict.fromkeys(inputs)  # an op reading a tensor twice is its user once
            for name in inputs:
                ops = found(name)
                if ops is None:
                    users[name] = [op]
                else:
                    ops.append(op)
        return {name: tuple(ops) for name, ops in users.items()}

    def tensors_with(self, role: Role) -> Iterator[Tensor]:
        return (t for t in self.tensors.values() if t.role is role)

    @property
    def weights(self) -> list[Tensor]:
        """The model's parameters (not the updated copies an optimizer op produces)."""
        return [t for t in self.tensors_with(Role.WEIGHT) if t.name not in self.producer]

    def parameter_count(self) -> sympy.Expr:
        return sympy.Add(*(w.numel for w in self.weights))

    def verify(self) -> None:
        """Raise GraphError naming the op and tensor on the first broken invariant. A sharded
        graph has tens of thousands of ops: an op's inputs are checked as one set, and named
        one by one only when that check fails."""
        tensors, free = self.tensors, (Role.INPUT, Role.WEIGHT, Role.OPTIMIZER_STATE)
        produced: set[str] = set()
        available = {name for name, tensor in tensors.items() if tensor.role in free}  # and, as it goes, produced
        seen_ops: set[str] = set()
        for op in self.ops:
            if op.name in seen_ops:
                raise GraphError(f"op {op.name}: name used twice")
            seen_ops.add(op.name)
            if not available.issuperset(op.inputs):
                missing = next(name for name in op.inputs if name not in available)
                if missing not in tensors:
                    raise GraphError(f"op {op.name}: input {missing} is not a tensor of the graph")
                raise GraphError(f"op {op.name}: input {missing} is used before it is produced (cycle or misordered ops)")
            for name in op.outputs:
                if name not in tensors:
                    raise GraphError(f"op {op.name}: output {name} is not a tensor of the graph")
                if name in produced:
                    raise GraphError(f"op {op.name}: output {name} is produced twice")
                produced.add(name)
            available.update(op.outputs)
        used = self.consumers  # the later passes read it too
        for weight in self.tensors_with(Role.WEIGHT):  # the model's: an optimizer produces the updated copies
            if weight.name not in produced and weight.name not in used:
                raise GraphError(f"weight {weight.name} {weight} is never used by any op")

    def __str__(self) -> str:
        lines = []
        for op in self.ops:
            outs = ", ".join(f"%{o}: {self.tensors[o]}" for o in op.outputs)
            args = ", ".join(f"%{i}" for i in op.inputs)
            lines.append(f"{outs} = {op.label()}({args})  # {op.phase.value} flops={op.flops}")
        return "\n".join(lines)

    def kinds(self) -> Counter:
        return Counter(op.kind for op in self.ops)
