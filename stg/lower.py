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
from typing import Mapping

import sympy

from stg.device import DeviceSpec
from stg.errors import LayoutError
from stg.graph import Op, OpKind, Phase
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

    def to_dict(self) -> dict:
        fb = sum(v for k, v in self.flops_by_phase.items() if k != Phase.STEP.value)
        return {
            "flops": sum(self.flops_by_phase.values()),
            "flops_forward_backward": fb,
            "flops_optimizer": self.flops_by_phase.get(Phase.STEP.value, 0),
            "flops_by_phase": {k: self.flops_by_phase[k] for k in sorted(self.flops_by_phase)},
            "matmul_flops_forward_backward": self.matmul_flops,
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

    @property
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


class _ProgramBuilder:
    def __init__(self, sharded: ShardedGraph, evaluate: Evaluator, device: DeviceSpec, bucket_bytes: int):
        self.graph = sharded.graph
        self.ev = evaluate
        self.device = device
        self.bucket_bytes = bucket_bytes
        self.nodes: list[TraceNode] = []
        self.last_compute: int | None = None
        self.last_collective: dict[tuple[str, ...], int] = {}
        self.stats = ClassStats()

    def _add(self, **kwargs) -> int:
        node = TraceNode(id=len(self.nodes), **kwargs)
        self.nodes.append(node)
        self.stats.nodes[node.type.name] += 1
        return node.id

    def _is_comm(self, node_id: int | None) -> bool:
        return node_id is not None and self.nodes[node_id].type is not NodeType.COMP_NODE

    def compute(self, op: Op, label: str, where: dict[str, int]) -> None:
        flops, nbytes = self.ev(op.flops), self.ev(op.bytes)
        deps = [self.last_compute] if self.last_compute is not None else []
        deps += sorted({where[i] for i in op.inputs if self._is_comm(where.get(i))})
        node = self._add(
            name=f"{label} {op.name}", type=NodeType.COMP_NODE, deps=tuple(deps), flops=flops, nbytes=nbytes,
            duration_us=round(self.device.duration_us(flops, nbytes)), op_type=op.label(),
        )
        self.last_compute = node
        for out in op.outputs:
            where[out] = node
        self.stats.flops_by_phase[op.phase.value] += flops
        self.stats.compute_bytes += nbytes
        if op.kind is OpKind.EINSUM and op.phase is not Phase.STEP:
            self.stats.matmul_flops += flops

    def collective(self, name: str, collective: Collective, axes: tuple[str, ...], nbytes: int, producers) -> int:
        deps = set(p for p in producers if p is not None)
        if axes in self.last_collective:
            deps.add(self.last_collective[axes])
        node = self._add(
            name=name, type=NodeType.COMM_COLL_NODE, deps=tuple(sorted(deps)), collective=collective,
            comm_bytes=nbytes, group=GroupHole(axes),
        )
        self.last_collective[axes] = node
        self.stats.comm_bytes[collective.name] += nbytes
        self.stats.comm_count[collective.name] += 1
        return node

    def op(self, op: Op, label: str, where: dict[str, int]) -> None:
        if op.kind is OpKind.SLICE:
            where[op.outputs[0]] = where.get(op.inputs[0])  # a view: same producer
        elif op.kind is OpKind.COLLECTIVE:
            where[op.outputs[0]] = self.collective(
                f"{label} {op.name}", op.attrs["collective"], op.attrs["axes"], self.ev(op.bytes), [where.get(op.inputs[0])]
            )
        else:
            self.compute(op, label, where)

    def gradient_buckets(self, step_ops: list[Op], where: dict[str, int]) -> None:
        """Coalesce the step's collectives on gradients finished in the micro-batches."""
        ready = [op for op in step_ops if op.kind is OpKind.COLLECTIVE and op.inputs[0] in where]
        ready.sort(key=lambda op: where[op.inputs[0]])
        bucket: list[Op] = []

        def flush():
            if not bucket:
                return
            first = bucket[0]
            node = self.collective(
                f"S grad_bucket{self.stats.comm_count[first.attrs['collective'].name]} {first.name} +{len(bucket) - 1}",
                first.attrs["collective"], first.attrs["axes"], sum(self.ev(op.bytes) for op in bucket),
                [where[op.inputs[0]] for op in bucket],
            )
            for op in bucket:
                where[op.outputs[0]] = node
            bucket.clear()

        for op in ready:
            if bucket and (op.attrs["collective"], op.attrs["axes"]) != (bucket[0].attrs["collective"], bucket[0].attrs["axes"]):
                flush()
            bucket.append(op)
            if sum(self.ev(o.bytes) for o in bucket) >= self.bucket_bytes:
                flush()
        flush()
        return {op.name for op in ready}

    def build(self, microbatches: int) -> list[TraceNode]:
        ops = self.graph.ops
        micro = [op for op in ops if op.phase is not Phase.STEP]
        step = [op for op in ops if op.phase is Phase.STEP]
        where: dict[str, int] = {}
        for mb in range(microbatches):
            where = {}
            for op in micro:
                self.op(op, f"{mb}{op.phase.value}", where)
        bucketed = self.gradient_buckets(step, where)
        for op in step:
            if op.name not in bucketed:
                self.op(op, "S", where)
        return self.nodes


def lower(sharded: ShardedGraph, evaluate: Evaluator, device: DeviceSpec, *, microbatches: int,
          bucket_bytes: int, key: tuple = ()) -> RankProgram:
    """One rank class's program: `microbatches` forward/backward passes, then the step."""
    builder = _ProgramBuilder(sharded, evaluate, device, bucket_bytes)
    nodes = builder.build(microbatches)
    return RankProgram(key, tuple(nodes), builder.stats)
