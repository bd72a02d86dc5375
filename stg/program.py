"""What lowering produces: one rank class's trace nodes with holes for rank-specific values.

A hole stands for a value that differs between the ranks of a class: a communicator group id
(GroupHole) or a rank number (RankHole: the rank itself, or its peer on another pipeline
stage). stg/chakra/writer.py serializes a program once and patches the holes per rank.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from functools import cached_property
from itertools import chain
from operator import attrgetter

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


def plain_hole(hole: Hole) -> tuple | int | None:
    """A hole as plain values, equal where the holes are equal: a hole's dataclass hash and
    equality are Python calls, and a slice sweeps thousands of keys."""
    return (hole.axes, hole.members) if type(hole) is GroupHole else hole.stage


def plain_key(key: tuple) -> tuple:
    """A comm key (TraceNode.comm_key) as plain values: a collective's group as plain_hole's two,
    a send's or receive's peers as plain_hole's."""
    if len(key) == 3:
        return (*plain_hole(key[0]), key[1], key[2])
    return plain_hole(key[0]), plain_hole(key[1]), key[2], key[3]


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

    def add(self, other: "ClassStats", times: int = 1) -> None:
        """self += times * other."""
        for name in ("flops_by_phase", "comm_bytes", "comm_count", "nodes"):
            counter = getattr(self, name)
            for key, value in getattr(other, name).items():
                counter[key] += times * value
        for name in ("compute_bytes", "send_bytes", "recv_bytes", "matmul_flops", "recompute_flops"):
            setattr(self, name, getattr(self, name) + times * getattr(other, name))

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
class CommNodes:
    """The communication nodes of ReplayNodes as arrays: per node its position, its key (an
    index into `keys`: (GroupHole, collective type, bytes) of a collective, (src, dst, tag,
    bytes) of a send or receive, holes standing for the ranks) and how far its tag is shifted
    from its key's (a repeated action's messages: its micro-batch's; 0 for a collective). A
    program's 10^4-10^5 comm nodes share a few hundred key objects (a repeated action's are
    its template's), so a reader translates each key once, not each node's."""

    at: np.ndarray
    key: np.ndarray
    shift: np.ndarray
    keys: tuple[tuple, ...]

    @classmethod
    def of(cls, comm: Mapping[int, tuple]) -> "CommNodes":
        """From keys by position (each node's key as it is: no shift)."""
        distinct = {id(key): key for key in comm.values()}
        place = dict(zip(distinct, range(len(distinct))))
        n = len(comm)
        key = np.fromiter(map(place.__getitem__, map(id, comm.values())), np.int64, n)
        return cls(np.fromiter(comm, np.int64, n), key, np.zeros(n, dtype=np.int64), tuple(distinct.values()))

    @classmethod
    def joined(cls, parts: Sequence[tuple[int, "CommNodes"]]) -> "CommNodes":
        """The parts' nodes, each part's positions offset by its int, their keys listed once."""
        if not parts:
            return cls.of({})
        distinct: dict[int, tuple] = {}  # by identity, in order of first use
        for _, part in parts:
            distinct.update(zip(map(id, part.keys), part.keys))
        place = dict(zip(distinct, range(len(distinct))))
        index = lambda part: np.fromiter(map(place.__getitem__, map(id, part.keys)), np.int64, len(part.keys))
        return cls(np.concatenate([part.at + offset for offset, part in parts]),
                   np.concatenate([index(part)[part.key] for _, part in parts]),
                   np.concatenate([part.shift for _, part in parts]), tuple(distinct.values()))

    def items(self):
        """(position, key) per node, a shifted tag added to its key's."""
        keys = self.keys
        for at, key, shift in zip(self.at.tolist(), self.key.tolist(), self.shift.tolist()):
            k = keys[key]
            yield at, (k[0], k[1], k[2] + shift, k[3]) if shift else k

    def __len__(self) -> int:
        return len(self.at)


@dataclass(frozen=True)
class ReplayNodes:
    """A program as the timed replay reads it (stg/slice_check.py): each run of COMP nodes that
    nothing else touches merged into its first, which lasts the run's sum; every start, finish
    and wait of the replay is that of the whole node list. Per kept node, in id order: its id,
    type, dependencies (kept nodes' ids, `n_deps` of them each, flattened) and duration; its
    communication nodes' keys (CommNodes: positions among the kept nodes)."""

    ids: Sequence[int]
    types: Sequence[int]
    n_deps: Sequence[int]
    deps: Sequence[int]  # a dependency may repeat (the replay's graph counts each once)
    durations: Sequence[float]
    comm: CommNodes


def merged_runs(comp: Sequence[bool], deps: Sequence[Sequence[int]], ends: Collection[int] = ()) -> list[int]:
    """Per node, the first node of its run of COMP nodes (the replay's merge, ReplayNodes): a
    COMP node whose one dependency is a COMP node that nothing else depends on joins that
    node's run, unless that node is in `ends`. `deps` index the same nodes; -1 stands for a
    node from elsewhere."""
    readers = Counter(d for node_deps in deps for d in node_deps)
    head: list[int] = []
    for n, node_deps in enumerate(deps):
        d = node_deps[0] if len(node_deps) == 1 else -1
        joins = comp[n] and d >= 0 and comp[d] and readers[d] == 1 and d not in ends
        head.append(head[d] if joins else n)
    return head


def replay_nodes(nodes: Sequence[TraceNode], head: Sequence[int], start: int = 0,
                 outside: Mapping[int, int] | None = None) -> ReplayNodes:
    """Nodes start, start + 1, ... merged into the first of their runs (`head`: offsets, see
    merged_runs), each run lasting its nodes' sum; a dependency on a node before `start` reads
    through `outside` (a merged run's last node -> its first)."""
    outside = outside or {}
    durations: dict[int, int] = {}
    for n, node in enumerate(nodes):
        if node.type is NodeType.COMP_NODE:
            durations[head[n]] = durations.get(head[n], 0) + node.duration_us
    ids, types, n_deps, flat, times, comm = [], [], [], [], [], {}
    for n, node in enumerate(nodes):
        if head[n] != n:
            continue
        deps = sorted({start + head[d - start] if d >= start else outside.get(d, d) for d in node.deps})
        if node.type is not NodeType.COMP_NODE:
            comm[len(ids)] = node.comm_key
        ids.append(start + n)
        types.append(int(node.type))
        n_deps.append(len(deps))
        flat.extend(deps)
        times.append(durations.get(n, 0))
    return ReplayNodes(ids, types, n_deps, flat, times, CommNodes.of(comm))


def program_replay(nodes: Sequence[TraceNode]) -> ReplayNodes:
    """A whole program's ReplayNodes (ids 0..n-1): replay_nodes(nodes, merged_runs(...)) when
    its COMP nodes form one chain (lowering's single compute stream: only a run's next can
    start), every node kept as it is otherwise; the same numbers, found as arrays (a class
    has hundreds of thousands of nodes, and `stg generate` replays a slice before writing)."""
    n = len(nodes)
    types = np.fromiter(map(attrgetter("type"), nodes), np.int64, n)
    lengths = np.fromiter(map(len, map(attrgetter("deps"), nodes)), np.int64, n)
    flat = np.fromiter(chain.from_iterable(map(attrgetter("deps"), nodes)), np.int64, int(lengths.sum()))
    owner = np.repeat(np.arange(n), lengths)
    comp = types == NodeType.COMP_NODE
    places = np.flatnonzero(comp)
    # one stream: each COMP node depends on the COMP node before it
    pairs = np.unique(owner * n + flat)
    wanted = places[1:] * n + places[:-1]
    one_stream = bool(np.isin(wanted, pairs, assume_unique=True).all()) if len(wanted) else True
    head = np.arange(n)
    if one_stream:  # merged_runs: the one dependency is a COMP node nothing else reads
        readers = np.bincount(flat, minlength=n)
        alone = np.flatnonzero(comp & (lengths == 1))  # COMP nodes of one dependency
        first = flat[(np.cumsum(lengths) - lengths)[alone]]  # that dependency
        joins = comp[first] & (readers[first] == 1)
        head[alone[joins]] = first[joins]
        while True:  # each node's run's first node (a dependency is an earlier node)
            deeper = head[head]
            if np.array_equal(deeper, head):
                break
            head = deeper
    kept = head == np.arange(n)
    durations = np.fromiter(map(attrgetter("duration_us"), nodes), np.float64, n)
    times = np.bincount(head, weights=np.where(comp, durations, 0), minlength=n)[kept]
    # each kept node's dependencies, read through the runs, distinct and sorted
    keep = kept[owner]
    by_pair = np.unique(owner[keep] * n + head[flat[keep]])
    dep_owner, deps = np.divmod(by_pair, n)
    ids = np.flatnonzero(kept)
    n_deps = np.bincount(dep_owner, minlength=n)[kept]
    comm_places = np.flatnonzero(~comp)  # never merged
    at = np.searchsorted(ids, comm_places)
    comm = {int(place): nodes[node].comm_key for place, node in zip(at, comm_places)}
    return ReplayNodes(ids, types[kept], n_deps, deps, times, CommNodes.of(comm))


@dataclass(frozen=True, eq=False)
class Repeats:
    """Repeated actions as lowering's flush has them (stg/repeats.py flush_arrays), their rows
    not yet made: the templates packed into one array (stg/repeats_kernel.py says how), each
    template's place there, its unrounded COMP durations and the place of its comm keys among
    `keys`; per repeat its template, first node id, tag shift, and (all repeats' in order) the
    nodes from before it that its dependencies name; the rounding carry they start from.
    explore's slice replay reads them as they are (stg/chakra/repeat_paths.py)."""

    packed: np.ndarray
    at: np.ndarray
    exacts: np.ndarray
    exact_at: np.ndarray
    key_at: np.ndarray
    template: np.ndarray
    start: np.ndarray
    shift: np.ndarray
    outside: np.ndarray
    carry: float
    keys: tuple[tuple, ...]
    key_group: np.ndarray  # per key, its group of equal keys
    group_first: np.ndarray  # per group, the index of its first key

    @cached_property
    def after(self) -> tuple[float, np.ndarray]:
        """The carry after their COMP runs are rounded, and their comm nodes' ids."""
        from stg.repeats_kernel import carried  # compiled: timing only

        return carried(self.packed, self.at, self.exacts, self.exact_at, self.template, self.start, self.carry)

    def rows(self) -> tuple[tuple, CommNodes]:
        """Their rows (ids, types, n_deps, deps, durations) and comm nodes, as flushing them made."""
        from stg.repeats_kernel import repeated_rows  # compiled: timing only

        ids, types, n_deps, deps, sums, _, comm_at, comm_key, comm_shift, _ = repeated_rows(
            self.packed, self.at, self.exacts, self.exact_at, self.template, self.start, self.shift, self.outside,
            self.key_at, self.carry)
        return (ids, types, n_deps, deps, sums), CommNodes(comm_at, comm_key, comm_shift, self.keys)


class ReplayChunks:
    """ReplayNodes built a run of nodes at a time (lowering for timing: an action's nodes come
    as arrays, repeated actions as Repeats), joined when first asked for."""

    def __init__(self) -> None:
        self.parts: list[tuple | Repeats] = []  # rows (ids, types, n_deps, deps, durations, comm), or Repeats
        self.ids = 0  # node ids taken (set when lowering ends): every id a part names is below

    def add(self, ids, types, n_deps, deps, durations, comm: CommNodes | None = None) -> None:
        """Append nodes: ids, types, dependency counts, flat dependencies and durations
        (sequences or arrays), and their comm nodes (positions among them)."""
        self.parts.append((ids, types, n_deps, deps, durations, comm))

    def add_repeats(self, repeats: Repeats) -> None:
        self.parts.append(repeats)

    @property
    def repeats(self) -> list[Repeats] | None:
        """The parts, where there are some and all are Repeats (all of a program's are but for
        an action that could not be recorded, stg.lower._ProgramBuilder._add_to_replay)."""
        repeats = [part for part in self.parts if isinstance(part, Repeats)]
        return repeats if repeats and len(repeats) == len(self.parts) else None

    def nodes(self) -> ReplayNodes:
        chunks, comm, size = [], [], 0
        for part in self.parts:
            rows, nodes = part.rows() if isinstance(part, Repeats) else (part[:5], part[5])
            if nodes is not None and len(nodes):
                comm.append((size, nodes))
            chunks.append(rows)
            size += len(rows[0])
        joined = [np.concatenate([np.asarray(c[k], dtype=np.float64 if k == 4 else np.int64) for c in chunks])
                  if chunks else np.empty(0) for k in range(5)]
        return ReplayNodes(*joined, CommNodes.joined(comm))


@dataclass(frozen=True)
class RankProgram:
    key: tuple
    nodes: tuple[TraceNode, ...]
    stats: ClassStats
    counted_holes: frozenset | None = None  # a program lowered without its nodes: their holes
    timed: ReplayChunks | None = None  # lowered for the timed replay only: its compact nodes, in parts

    @cached_property
    def replay(self) -> ReplayNodes | None:
        """A program lowered for the timed replay only: its compact nodes."""
        return self.timed.nodes() if self.timed is not None else None

    @cached_property
    def holes(self) -> list[Hole]:
        found = self.counted_holes
        if found is None:  # three plain passes: most nodes are COMP and have none
            found = {n.group for n in self.nodes} | {n.src for n in self.nodes} | {n.dst for n in self.nodes}
            found.discard(None)
        return sorted(found, key=lambda h: (isinstance(h, RankHole), str(h)))
