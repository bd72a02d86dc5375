"""What lowering produces: one rank class's trace nodes with holes for rank-specific values.

A hole stands for a value that differs between the ranks of a class: a communicator group id
(GroupHole) or a rank number (RankHole: the rank itself, or its peer on another pipeline
stage). stg/chakra/writer.py serializes a program once and patches the holes per rank.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from functools import cached_property

import numpy as np

from stg.graph import Phase
from stg.redistribute import Collective


class NodeType(IntEnum):
    """Chakra's NodeType numbers, for the four kinds stg emits."""

    COMP_NODE = 4
    COMM_SEND_NODE = 5
    COMM_RECV_NODE = 6
    COMM_COLL_NODE = 7


@dataclass(frozen=True)
class GroupHole:
    """Stands for 'this rank's communicator group along `axes`' until a rank is stamped;
    `members` keeps only these coordinates of a one-axis group (Megatron's embedding group:
    the first and last pipeline stage)."""

    axes: tuple[str, ...]
    members: tuple[int, ...] | None = None

    def __str__(self) -> str:
        return "+".join(self.axes) + (f"{list(self.members)}" if self.members else "")


@dataclass(frozen=True)
class RankHole:
    """A rank number: this rank's own (stage None), or the rank at pipeline stage `stage`
    with the same coordinates on every other mesh axis (a send/recv peer)."""

    stage: int | None = None


Hole = GroupHole | RankHole


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
    src: RankHole | None = None  # send/recv
    dst: RankHole | None = None
    tag: int = 0

    @property
    def holes(self) -> tuple[Hole, ...]:
        return tuple(h for h in (self.group, self.src, self.dst) if h is not None)

    @property
    def comm_key(self) -> tuple | None:
        """What the replay matches it by, holes for ranks: (group, collective type, bytes) of a
        collective, (src, dst, tag, bytes) of a send or receive; None for compute."""
        if self.type is NodeType.COMP_NODE:
            return None
        if self.type is NodeType.COMM_COLL_NODE:
            return self.group, self.collective.value, self.comm_bytes
        return self.src, self.dst, self.tag, self.comm_bytes


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

    def add(self, other: "ClassStats") -> None:
        for name in ("flops_by_phase", "comm_bytes", "comm_count", "nodes"):
            getattr(self, name).update(getattr(other, name))
        for name in ("compute_bytes", "send_bytes", "recv_bytes", "matmul_flops", "recompute_flops"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

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
class ReplayNodes:
    """A program as the timed replay reads it (stg/slice_check.py): each run of COMP nodes that
    nothing else touches merged into its first, which lasts the run's sum; every start, finish
    and wait of the replay is that of the whole node list. Per kept node, in id order: its id,
    type, dependencies (kept nodes' ids, `n_deps` of them each, flattened) and duration; `comm`
    by position: (GroupHole, collective type, bytes) of a collective, (src, dst, tag, bytes) of
    a send or receive, holes standing for the ranks."""

    ids: Sequence[int]
    types: Sequence[int]
    n_deps: Sequence[int]
    deps: Sequence[int]  # a dependency may repeat (the replay's graph counts each once)
    durations: Sequence[float]
    comm: dict[int, tuple]


class ReplayChunks:
    """ReplayNodes built a run of nodes at a time (lowering for timing: an action's nodes come
    as arrays), joined once at the end."""

    def __init__(self) -> None:
        self.chunks: list[tuple] = []
        self.size = 0  # nodes so far
        self.comm: dict[int, tuple] = {}

    def add(self, ids, types, n_deps, deps, durations) -> None:
        """Append nodes: ids, types, dependency counts, flat dependencies and durations
        (sequences or arrays); their comm entries go in self.comm at self.size + position first."""
        self.chunks.append((ids, types, n_deps, deps, durations))
        self.size += len(ids)

    def nodes(self) -> ReplayNodes:
        joined = [np.concatenate([np.asarray(c[k], dtype=np.float64 if k == 4 else np.int64) for c in self.chunks])
                  if self.chunks else np.empty(0) for k in range(5)]
        return ReplayNodes(*joined, self.comm)


@dataclass(frozen=True)
class RankProgram:
    key: tuple
    nodes: tuple[TraceNode, ...]
    stats: ClassStats
    counted_holes: frozenset | None = None  # a program lowered without its nodes: their holes
    replay: ReplayNodes | None = None  # lowered for the timed replay only: its compact nodes

    @cached_property
    def holes(self) -> list[Hole]:
        found = self.counted_holes
        if found is None:  # three plain passes: most nodes are COMP and have none
            found = {n.group for n in self.nodes} | {n.src for n in self.nodes} | {n.dst for n in self.nodes}
            found.discard(None)
        return sorted(found, key=lambda h: (isinstance(h, RankHole), str(h)))
