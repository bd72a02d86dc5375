"""Lowering: the sharded graph, bound to numbers, becomes the node list of one rank *class*.

Ranks that run the same program up to their communicator groups and peers form a class and
share one RankProgram. Where a node names a group it holds a GroupHole (which group along
which mesh axes), filled in per rank by byte patching when the files are written
(stg/chakra/writer.py); nothing here runs per rank.

Order (DESIGN.md, "Chakra output"): all orderings go into data deps. Compute nodes form one
chain in program order (one compute stream); each collective follows its input's producer
and the previous collective on the same group (one NCCL stream per communicator, and the
k-th collectives of a group's members are paired); consumers follow the collectives they read.
Gradient synchronisation runs once per step: the weight-gradient collectives are coalesced
into buckets in the order the last micro-batch finishes the gradients (PyTorch DDP's
bucketing), so they overlap the rest of that backward, and the optimizer follows them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from enum import IntEnum
from functools import cached_property
from typing import Mapping

import sympy

from stg.device import DeviceSpec
from stg.errors import LayoutError
from stg.graph import Op, OpKind, Phase, Role
from stg.mesh import axis_symbol
from stg.redistribute import Collective
from stg.sharding import ShardedGraph


class NodeType(IntEnum):
    """Chakra's NodeType numbers, for the four kinds stg emits."""

    COMP_NODE = 4
    COMM_SEND_NODE = 5
    COMM_RECV_NODE = 6
    COMM_COLL_NODE = 7


@dataclass(frozen=True)
class GroupHole:
    """Stands for 'this rank's communicator group along `axes`' until a rank is stamped."""

    axes: tuple[str, ...]


@dataclass(frozen=True)
class TraceNode:
    id: int
    name: str
    type: NodeType
    deps: tuple[int, ...]
    flops: int = 0
    nbytes: int = 0
    duration_us: int = 0
    op_type: str = ""
    collective: Collective | None = None
    comm_bytes: int = 0
    group: GroupHole | None = None


@dataclass
class ClassStats:
    """Per-rank totals of one rank class for one training step."""

    flops_by_phase: Counter = field(default_factory=Counter)
    compute_bytes: int = 0
    comm_bytes: Counter = field(default_factory=Counter)  # by collective name
    comm_count: Counter = field(default_factory=Counter)
    send_bytes: int = 0
    recv_bytes: int = 0
    nodes: Counter = field(default_factory=Counter)  # by node type name
    matmul_flops: int = 0  # einsum FLOPs of forward and backward (excludes the optimizer)
    recompute_flops: int = 0  # forward work re-run in the backward (counted in phase B too)

    def to_dict(self) -> dict:
        fb = sum(v for k, v in self.flops_by_phase.items() if k != Phase.STEP.value)
        return {
            "flops": sum(self.flops_by_phase.values()),
            "flops_forward_backward": fb,
            "flops_optimizer": self.flops_by_phase.get(Phase.STEP.value, 0),
            "flops_by_phase": {k: self.flops_by_phase[k] for k in sorted(self.flops_by_phase)},
            "matmul_flops_forward_backward": self.matmul_flops,
            "flops_recompute": self.recompute_flops,
            "compute_bytes": self.compute_bytes,
            "comm_bytes": dict(sorted(self.comm_bytes.items())),
            "comm_count": dict(sorted(self.comm_count.items())),
            "send_bytes": self.send_bytes,
            "recv_bytes": self.recv_bytes,
            "nodes": dict(sorted(self.nodes.items())),
        }


@dataclass(frozen=True)
class RankProgram:
    key: tuple
    nodes: tuple[TraceNode, ...]
    stats: ClassStats

    @cached_property
    def holes(self) -> list[GroupHole]:
        return sorted({n.group for n in self.nodes if n.group is not None}, key=lambda h: h.axes)


class Evaluator:
    """Binds symbols to integers, once per distinct expression (never per node per rank)."""

    def __init__(self, bindings: Mapping[sympy.Symbol, object]):
        self.bindings = {k: sympy.sympify(v) for k, v in bindings.items()}
        self.cache: dict[sympy.Expr, int] = {}

    def __call__(self, expr: sympy.Expr) -> int:
        value = self.cache.get(expr)
        if value is None:
            bound = sympy.sympify(expr).xreplace(self.bindings)
            if not bound.is_number:
                raise AssertionError(f"unbound symbols {bound.free_symbols} in {expr}")
            value = int(sympy.ceiling(bound))
            self.cache[expr] = value
        return value


def check_divisibility(sharded: ShardedGraph, bindings: Mapping[sympy.Symbol, int]) -> None:
    """Every split dimension divides evenly, or a LayoutError names tensor, axis and sizes."""
    checked = set()
    for name, layout in sharded.layouts.items():
        tensor = sharded.global_tensors[name]
        for dim, (size, logical) in enumerate(zip(tensor.shape, tensor.dims)):
            axes = layout.axes_sharding(dim)
            if not axes or (size, axes) in checked:
                continue
            checked.add((size, axes))
            value = int(size.xreplace(bindings))
            parts = int(sympy.Mul(*(axis_symbol(a) for a in axes)).xreplace(bindings))
            if value % parts:
                split = "*".join(f"{a}={int(axis_symbol(a).xreplace(bindings))}" for a in axes)
                raise LayoutError(
                    f"{split} does not divide {logical} dimension {size}={value} of tensor {name}"
                )


def _unit(op: Op, graph) -> tuple | None:
    """The coalescing unit of a collective that moves parameters or gradients (FSDP's unit:
    one block, one phase); None for activation traffic, which runs where it stands."""
    if op.kind is not OpKind.COLLECTIVE:
        return None
    role = graph.tensors[op.inputs[0]].role
    if role not in (Role.WEIGHT, Role.GRADIENT):
        return None
    return (role, op.phase, op.layer, op.attrs["collective"], op.attrs["axes"])


class _ProgramBuilder:
    def __init__(self, sharded: ShardedGraph, evaluate: Evaluator, device: DeviceSpec, bucket_bytes: int):
        self.graph = sharded.graph
        self.ev = evaluate
        self.device = device
        self.bucket_bytes = bucket_bytes
        self.nodes: list[TraceNode] = []
        self.last_compute: int | None = None
        self.last_collective: dict[tuple[str, ...], int] = {}
        self.alias: dict[str, str] = {}  # a view (slice, anchor) -> the tensor it views
        self.prefetch: dict[Phase, int | None] = {}  # compute running when the last unit gather went out
        self.stats = ClassStats()

    def _add(self, **kwargs) -> int:
        node = TraceNode(id=len(self.nodes), **kwargs)
        self.nodes.append(node)
        self.stats.nodes[node.type.name] += 1
        return node.id

    def producer(self, tensor: str, where: dict[str, int]) -> int | None:
        while tensor in self.alias:
            tensor = self.alias[tensor]
        return where.get(tensor)

    def _is_comm(self, node_id: int | None) -> bool:
        return node_id is not None and self.nodes[node_id].type is not NodeType.COMP_NODE

    def compute(self, op: Op, label: str, where: dict[str, int]) -> None:
        flops, nbytes = self.ev(op.flops), self.ev(op.bytes)
        deps = [self.last_compute] if self.last_compute is not None else []
        deps += sorted({p for i in op.inputs if self._is_comm(p := self.producer(i, where))})
        node = self._add(
            name=f"{label} {op.name}", type=NodeType.COMP_NODE, deps=tuple(deps), flops=flops, nbytes=nbytes,
            duration_us=round(self.device.duration_us(flops, nbytes)), op_type=op.label(),
        )
        self.last_compute = node
        for out in op.outputs:
            where[out] = node
        self.stats.flops_by_phase[op.phase.value] += flops
        self.stats.compute_bytes += nbytes
        if op.attrs.get("recompute"):
            self.stats.recompute_flops += flops
        if op.kind is OpKind.EINSUM and op.phase is not Phase.STEP:
            self.stats.matmul_flops += flops

    def collective(self, name: str, members: list[Op], where: dict[str, int], extra_deps=()) -> int:
        first = members[0]
        axes, collective = first.attrs["axes"], first.attrs["collective"]
        deps = {p for op in members if (p := self.producer(op.inputs[0], where)) is not None} | set(extra_deps)
        if axes in self.last_collective:
            deps.add(self.last_collective[axes])
        nbytes = sum(self.ev(op.bytes) for op in members)
        node = self._add(
            name=name, type=NodeType.COMM_COLL_NODE, deps=tuple(sorted(d for d in deps if d is not None)),
            collective=collective, comm_bytes=nbytes, group=GroupHole(axes),
        )
        self.last_collective[axes] = node
        for op in members:
            where[op.outputs[0]] = node
        self.stats.comm_bytes[collective.name] += nbytes
        self.stats.comm_count[collective.name] += 1
        return node

    def _bucket_name(self, label: str, members: list[Op]) -> str:
        extra = f" +{len(members) - 1}" if len(members) > 1 else ""
        return f"{label} {members[0].name}{extra}"

    def op(self, op: Op, label: str, where: dict[str, int]) -> None:
        if op.kind in (OpKind.SLICE, OpKind.CONSTRAIN):
            self.alias[op.outputs[0]] = op.inputs[0]  # a view: no node, same producer
        elif op.kind is OpKind.COLLECTIVE:
            self.collective(f"{label} {op.name}", [op], where)
        else:
            self.compute(op, label, where)

    def micro_batch(self, ops: list[Op], units: dict[tuple, list[Op]], mb: int) -> dict[str, int]:
        """One forward/backward. Parameter gathers of a unit go out together before its first
        use, one unit ahead of compute (FSDP's prefetch); gradient reductions of a unit go out
        together once its last gradient is done."""
        where: dict[str, int] = {}
        for op in ops:
            label = f"{mb}{op.phase.value}"
            unit = _unit(op, self.graph)
            if unit is None:
                self.op(op, label, where)
                continue
            members = units[unit]
            if unit[0] is Role.WEIGHT and op is members[0]:
                self.collective(self._bucket_name(label, members), members, where,
                                       [self.prefetch.get(op.phase)])
                self.prefetch[op.phase] = self.last_compute
            elif unit[0] is Role.GRADIENT and op is members[-1]:
                self.collective(self._bucket_name(label, members), members, where)
        return where

    def buckets(self, ops: list[Op], where: dict[str, int], order) -> None:
        """PyTorch DDP's bucketing: consecutive collectives of one kind, up to bucket_bytes."""
        bucket: list[Op] = []
        size = 0
        for op in sorted(ops, key=order):
            if bucket and _unit(op, self.graph)[3:] != _unit(bucket[0], self.graph)[3:]:
                self.collective(self._bucket_name("S", bucket), bucket, where)
                bucket, size = [], 0
            bucket.append(op)
            size += self.ev(op.bytes)
            if size >= self.bucket_bytes:
                self.collective(self._bucket_name("S", bucket), bucket, where)
                bucket, size = [], 0
        if bucket:
            self.collective(self._bucket_name("S", bucket), bucket, where)

    def step(self, ops: list[Op], where: dict[str, int]) -> None:
        """Gradient reductions (bucketed in the order the last micro-batch finished the
        gradients, so they overlap its backward), the optimizer, then the gathers of the new
        parameters (bucketed)."""
        colls = [op for op in ops if op.kind is OpKind.COLLECTIVE]
        finished = [op for op in colls if self.producer(op.inputs[0], where) is not None]
        self.buckets(finished, where, order=lambda op: self.producer(op.inputs[0], where))
        later = [op for op in colls if op not in finished]
        for op in ops:
            if op.kind is not OpKind.COLLECTIVE:
                self.op(op, "S", where)
        self.buckets(later, where, order=lambda op: self.producer(op.inputs[0], where))

    def build(self, microbatches: int) -> list[TraceNode]:
        micro = [op for op in self.graph.ops if op.phase is not Phase.STEP]
        units: dict[tuple, list[Op]] = {}
        for op in micro:
            if (unit := _unit(op, self.graph)) is not None:
                units.setdefault(unit, []).append(op)
        where: dict[str, int] = {}
        for mb in range(microbatches):
            where = self.micro_batch(micro, units, mb)
        self.step([op for op in self.graph.ops if op.phase is Phase.STEP], where)
        return self.nodes


def lower(sharded: ShardedGraph, evaluate: Evaluator, device: DeviceSpec, *, microbatches: int,
          bucket_bytes: int, key: tuple = ()) -> RankProgram:
    """One rank class's program: `microbatches` forward/backward passes, then the step."""
    builder = _ProgramBuilder(sharded, evaluate, device, bucket_bytes)
    nodes = builder.build(microbatches)
    return RankProgram(key, tuple(nodes), builder.stats)
