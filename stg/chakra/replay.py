"""Replays of all ranks together under ASTRA-sim's issue rules (B.4/B.5).

``Replay`` is zero-time and answers one question: does the set wedge? ``TimedReplay`` is a
discrete-event run of the same rules with COMP durations and a simple communication cost, for
reading pipeline bubbles (idle time per rank) off a trace set. Both report a deadlock the same way.
"""

from __future__ import annotations

import heapq
from array import array
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from stg.chakra import et_def_pb2 as pb
from stg.chakra.rank_graph import COLL, COMP, RECV, CommKey, Problem, RankGraph, coll_name, group_label, p2p_text, type_name
from stg.errors import StgError

MAX_DEADLOCK_LINES = 10


class ReplayError(StgError):
    """A trace set that cannot be replayed (invalid, or it deadlocks); ``problems`` says why."""

    def __init__(self, message: str, problems: list[Problem]) -> None:
        shown = [str(p) for p in problems[:MAX_DEADLOCK_LINES + 2]]  # a deadlock report's lines fit
        if len(problems) > len(shown):
            shown.append(f"... and {len(problems) - len(shown)} more")
        super().__init__("\n  ".join([f"{message}:", *shown]))
        self.problems = problems


class _DeadlockReport:
    """Why ranks are stuck, from the state both replays keep under the same names."""

    graphs: list[RankGraph]
    members: dict[int, set[int]]
    done: list[int]
    in_slot: list[int]
    slot_ordinal: list[int]
    joined: dict[tuple[int, int], list[tuple[int, int]]]
    posted: dict[CommKey, deque[tuple[int, int]]]

    def _slot_waiter(self, r: int) -> int | None:
        """The lowest-id ready COLL/SEND of rank r that waits for the comm slot, if any."""
        raise NotImplementedError

    def _deadlock_report(self) -> list[Problem]:
        stuck = [g.rank for g in self.graphs if self.done[g.rank] < len(g.ids)]
        if not stuck:
            return []
        left = sum(len(self.graphs[r].ids) - self.done[r] for r in stuck)
        problems = [Problem(None, None, f"replay deadlocks: {len(stuck)} of {len(self.graphs)} ranks "
                                        f"stuck, {left} nodes never run")]
        problems.extend(self._why_stuck(r, set(stuck)) for r in stuck[:MAX_DEADLOCK_LINES])
        if len(stuck) > MAX_DEADLOCK_LINES:
            problems.append(Problem(None, None, f"... and {len(stuck) - MAX_DEADLOCK_LINES} more stuck ranks"))
        return problems

    def _why_stuck(self, r: int, stuck: set[int]) -> Problem:
        g = self.graphs[r]
        unfinished = f" ({len(g.ids) - self.done[r]} of {len(g.ids)} nodes unfinished)"
        if self.in_slot[r] >= 0:
            i, k = self.in_slot[r], self.slot_ordinal[r]
            group, ctype, size = g.comm[i]
            have = {m for m, _ in self.joined[(group, k)]}
            absent = sorted(self.members[group] - have)
            reason = (f"blocked in collective #{k + 1} on {group_label(group)} ({coll_name(ctype)} of "
                      f"{size} B); ranks {absent} have not issued it")
            w = self._slot_waiter(r)
            if w is not None:
                reason += f"; node {g.ids[w]} ({type_name(g.types[w])}) waits for the comm slot"
            return Problem(r, g.ids[i], reason + unfinished)
        recvs = sorted(j for q in self.posted.values() for m, j in q if m == r)
        if recvs:
            j = recvs[0]
            src = g.comm[j][0]
            peer = "is stuck too" if src in stuck else "has finished"
            more = f"; {len(recvs) - 1} more RECVs pending" if len(recvs) > 1 else ""
            return Problem(r, g.ids[j], f"waits in {p2p_text(RECV, g.comm[j])}, which was never sent; "
                                        f"rank {src} {peer}{more}{unfinished}")
        return Problem(r, None, "no node can become ready" + unfinished)


class Replay(_DeadlockReport):
    """Zero-time run of all ranks under ASTRA-sim's rules (B.4/B.5).

    Per rank the lowest-id issuable ready node goes first; COLL and SEND need the rank's single
    comm slot (a SEND is eager and frees it at once, a COLL holds it until every member joined);
    RECV waits for a deposited (src, dst, tag, size) message. Only ranks whose state changed are
    revisited, via a worklist.
    """

    def __init__(self, graphs: list[RankGraph], groups: dict[int, tuple[int, ...]]) -> None:
        self.graphs = graphs
        self.members = {g: set(m) for g, m in groups.items()}
        self.pending = [array("q", g.n_parents) for g in graphs]
        self.ready = [[i for i, p in enumerate(g.n_parents) if p == 0] for g in graphs]  # sorted = heap
        self.slot_wait: list[list[int]] = [[] for _ in graphs]  # ready COLL/SEND behind a busy slot
        self.in_slot = [-1] * len(graphs)  # index of the collective holding the slot
        self.slot_ordinal = [0] * len(graphs)
        self.done = [0] * len(graphs)
        self.issued: list[dict[int, int]] = [{} for _ in graphs]  # group -> collectives issued
        self.joined: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (group, k) -> (rank, index)
        self.mailbox: Counter[CommKey] = Counter()
        self.posted: dict[CommKey, deque[tuple[int, int]]] = defaultdict(deque)
        self.work = deque(range(len(graphs)))
        self.queued = [True] * len(graphs)

    def run(self) -> list[Problem]:
        while self.work:
            r = self.work.popleft()
            self.queued[r] = False
            self._advance(r)
        return self._deadlock_report()

    def _wake(self, r: int) -> None:
        if not self.queued[r]:
            self.queued[r] = True
            self.work.append(r)

    def _finish(self, r: int, i: int) -> None:
        g, pending, ready = self.graphs[r], self.pending[r], self.ready[r]
        self.done[r] += 1
        for c in g.children[g.child_start[i]:g.child_start[i + 1]]:
            pending[c] -= 1
            if pending[c] == 0:
                heapq.heappush(ready, c)

    def _advance(self, r: int) -> None:
        # The hot loop of the replay: locals only, and a node completing here is finished inline.
        g, ready, wait, in_slot = self.graphs[r], self.ready[r], self.slot_wait[r], self.in_slot
        types, comm, children, start, pending = g.types, g.comm, g.children, g.child_start, self.pending[r]
        push, pop = heapq.heappush, heapq.heappop
        done = 0
        while True:
            if wait and in_slot[r] < 0 and (not ready or wait[0] < ready[0]):
                i = pop(wait)
            elif ready:
                i = pop(ready)
            else:
                break
            t = types[i]
            if t == RECV:
                key = comm[i]
                if not self.mailbox.get(key):
                    self.posted[key].append((r, i))
                    continue
                self.mailbox[key] -= 1
            elif t != COMP:
                if in_slot[r] >= 0:
                    push(wait, i)
                    continue
                if t == COLL:
                    self._join(r, i)  # finishes it (and its peers' halves) once all members joined
                    continue
                self._deposit(comm[i])  # SEND: eager, so it frees the slot at once
            done += 1
            for c in children[start[i]:start[i + 1]]:
                pending[c] -= 1
                if not pending[c]:
                    push(ready, c)
        self.done[r] += done

    def _deposit(self, key: CommKey) -> None:
        waiting = self.posted.get(key)
        if waiting:
            d, j = waiting.popleft()
            self._finish(d, j)
            self._wake(d)
        else:
            self.mailbox[key] += 1

    def _join(self, r: int, i: int) -> None:
        group = self.graphs[r].comm[i][0]
        k = self.issued[r].get(group, 0)
        self.issued[r][group] = k + 1
        self.in_slot[r], self.slot_ordinal[r] = i, k
        instance = self.joined.setdefault((group, k), [])
        instance.append((r, i))
        if len(instance) == len(self.members[group]):
            del self.joined[(group, k)]
            for m, j in instance:
                self.in_slot[m] = -1
                self._finish(m, j)
                if m != r:
                    self._wake(m)

    def _slot_waiter(self, r: int) -> int | None:
        return self.slot_wait[r][0] if self.slot_wait[r] else None


# --- timed replay ---------------------------------------------------------------------------


class CommModel(Enum):
    """How long communication takes in a timed replay."""

    FREE = "free"  # collectives end when the last member joins; sends take no time
    ALPHA_BETA = "alpha-beta"  # alpha + ring bytes / bandwidth


# Bytes each rank moves per byte of comm_size in a ring over n ranks (comm_size as in A.5:
# ALL_GATHER's is the per-rank shard, the others' the full per-rank buffer).
RING_FACTOR: dict[int, Callable[[int], float]] = {
    pb.ALL_REDUCE: lambda n: 2 * (n - 1) / n,
    pb.REDUCE_SCATTER: lambda n: (n - 1) / n,
    pb.ALL_GATHER: lambda n: n - 1,
    pb.ALL_TO_ALL: lambda n: (n - 1) / n,
}


@dataclass(frozen=True)
class CommCost:
    """Communication time under ``model``. The alpha-beta defaults (5 µs, 50 GB/s, GB = 1e9 B) are
    illustrative numbers for comparing schedules, not a network model: no topology, no contention."""

    model: CommModel = CommModel.FREE
    alpha_us: float = 5.0
    bandwidth_gbps: float = 50.0

    def __post_init__(self) -> None:
        if not isinstance(self.model, CommModel):
            raise ValueError(f"comm must be one of {[m.value for m in CommModel]}, got {self.model!r}")
        if not self.alpha_us >= 0:
            raise ValueError(f"alpha_us must be >= 0, got {self.alpha_us}")
        if not self.bandwidth_gbps > 0:
            raise ValueError(f"bandwidth_gbps must be > 0, got {self.bandwidth_gbps}")

    def collective_us(self, ctype: int, size: int, n: int) -> float:
        """Time from the last member joining to the collective's end."""
        if self.model is CommModel.FREE:
            return 0.0
        return self.alpha_us + RING_FACTOR[ctype](n) * size / (self.bandwidth_gbps * 1e3)

    def send_us(self, size: int) -> float:
        """Time from a SEND's issue to its message's arrival (the SEND holds the comm slot meanwhile)."""
        if self.model is CommModel.FREE:
            return 0.0
        return self.alpha_us + size / (self.bandwidth_gbps * 1e3)

    def bind(self, groups: Mapping[int, Sequence[int]]) -> "BoundCost":
        return _SizedCost(self, {g: len(m) for g, m in groups.items()})


class BoundCost(Protocol):
    """Communication times for one replay: a collective's by its group id, a send's by its
    (src, dst) ranks as the replay numbers them. A network model (stg/explore/network.py)
    needs the group's members to know which tiers it spans, so costs are bound to the groups."""

    def collective_us(self, ctype: int, size: int, group: int) -> float: ...

    def send_us(self, src: int, dst: int, size: int) -> float: ...


class CostModel(Protocol):
    def bind(self, groups: Mapping[int, Sequence[int]]) -> BoundCost: ...


@dataclass(frozen=True)
class _SizedCost:
    """A CommCost that knows each group's size."""

    cost: CommCost
    sizes: Mapping[int, int]

    def collective_us(self, ctype: int, size: int, group: int) -> float:
        return self.cost.collective_us(ctype, size, self.sizes[group])

    def send_us(self, src: int, dst: int, size: int) -> float:
        return self.cost.send_us(size)


@dataclass(frozen=True)
class NodeTimes:
    """Each node's issue and completion time on the ranks a timed replay recorded, in µs, by
    node index (a RankGraph's ascending-id order). A COLL is issued when its rank joins, a RECV
    when it is posted; ``messages`` pairs every SEND with the RECV that took its message
    (send rank, send index, recv rank, recv index), where either side is recorded."""

    ids: dict[int, array]  # node id by index
    start_us: dict[int, array]
    end_us: dict[int, array]
    messages: list[tuple[int, int, int, int]]


@dataclass(frozen=True)
class Timing:
    """What a timed replay measured, in µs; per-rank lists are indexed by rank."""

    makespan_us: float
    busy_us: list[float]  # sum of the rank's COMP durations
    idle_us: list[float]  # makespan - busy: the bubble plus exposed communication
    finish_us: list[float]  # when the rank's last node completed
    nodes: NodeTimes | None = field(default=None, compare=False, repr=False)  # when asked to record

    @classmethod
    def of(cls, busy: Sequence[float], finish: Sequence[float], nodes: NodeTimes | None = None) -> "Timing":
        """From each rank's COMP time and last end: the makespan is the latest end."""
        makespan = max(finish, default=0.0)
        return cls(makespan_us=makespan, busy_us=list(busy), idle_us=[makespan - b for b in busy],
                   finish_us=list(finish), nodes=nodes)

    def to_dict(self) -> dict[str, float | list[float]]:
        return {"makespan_us": self.makespan_us, "busy_us": list(self.busy_us),
                "idle_us": list(self.idle_us), "finish_us": list(self.finish_us)}

    def __str__(self) -> str:
        rows = [f"makespan {self.makespan_us:g} us"]
        rows += [f"rank {r}: busy {b:g} idle {i:g} ({i / self.makespan_us:.1%}) finish {f:g}"
                 if self.makespan_us else f"rank {r}: busy {b:g} idle {i:g} finish {f:g}"
                 for r, (b, i, f) in enumerate(zip(self.busy_us, self.idle_us, self.finish_us))]
        return "\n".join(rows)


# event kinds: a is a rank and b a node index, or a is a collective's (rank, index) list
_COMP_DONE, _SEND_DONE, _RECV_DONE, _COLL_DONE = range(4)


class TimedReplay(_DeadlockReport):
    """A discrete-event run of all ranks under ASTRA-sim's issue rules (B.4/B.5), with time.

    Per rank, one COMP runs at a time (``duration_micros``) and one COLL or SEND holds the comm
    slot; RECV holds nothing. Whenever a resource is free, the lowest-id ready node that needs it
    is issued. Matching is the logical replay's: the k-th collective on a group pairs with every
    member's k-th; p2p messages match on (src, dst, tag, size), FIFO. A collective ends
    ``collective_us`` after its last member joined, a SEND ``send_us`` after its issue, when its
    message arrives; a RECV ends when both it is issued and its message has arrived.

    Time advances in batches: every event at time t is applied (resources freed, children made
    ready), then each rank that changed issues. A zero-time completion (free comm, a 0 µs COMP)
    is an event at t, applied in the next batch at t, so it never pre-empts an issue decision
    already taken at t: that is the limit of ASTRA-sim's tiny-but-positive times. ASTRA-sim runs a
    0 µs COMP for 1 ns; here it takes 0. Event keys (time, kind, rank, index) are unique, so the
    order never depends on the order of pushes, and the same input gives the same numbers.
    ``run`` consumes the state: one run per instance. ``record``: ranks whose per-node times the
    Timing carries (NodeTimes); all ranks are replayed regardless.
    """

    def __init__(self, graphs: list[RankGraph], groups: dict[int, tuple[int, ...]],
                 durations: list[array], cost: CostModel, record: Collection[int] = ()) -> None:
        assert [g.rank for g in graphs] == list(range(len(graphs))), "graphs must be ranks 0..N-1"
        assert all(set(g.types) <= {COMP, COLL, pb.COMM_SEND_NODE, RECV} for g in graphs), "validate first"
        self.graphs, self.durations = graphs, durations
        self.members = {g: set(m) for g, m in groups.items()}
        self.cost = cost.bind(groups)
        self.pending = [g.n_parents.tolist() for g in graphs]  # lists: faster than arrays in the loop
        # ready nodes by the resource they need; each a heap of indices (lowest id first)
        self.comp_ready: list[list[int]] = [[] for _ in graphs]
        self.comm_ready: list[list[int]] = [[] for _ in graphs]
        self.recv_ready: list[list[int]] = [[] for _ in graphs]
        for g in graphs:
            comp, comm, recv = self.comp_ready[g.rank], self.comm_ready[g.rank], self.recv_ready[g.rank]
            for i, p in enumerate(g.n_parents):
                if p == 0:  # appended in ascending order, so each list is already a heap
                    t = g.types[i]
                    (comp if t == COMP else recv if t == RECV else comm).append(i)
        self.computing = [False] * len(graphs)
        self.in_slot = [-1] * len(graphs)  # index of the COLL/SEND holding the comm slot
        self.slot_ordinal = [0] * len(graphs)
        self.done = [0] * len(graphs)
        self.busy = [0.0] * len(graphs)
        self.finish = [0.0] * len(graphs)
        self.issued: list[dict[int, int]] = [{} for _ in graphs]  # group -> collectives issued
        self.joined: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (group, k) -> (rank, index)
        self.mailbox: Counter[CommKey] = Counter()  # arrived messages no RECV has taken yet
        self.posted: dict[CommKey, deque[tuple[int, int]]] = defaultdict(deque)  # RECVs waiting
        self.coll_us: dict[CommKey, float] = {}  # (group, type, size) -> duration
        self.events: list[tuple] = []  # heap of (time, kind, a, b)
        self.record = sorted(set(record))

    def run(self) -> Timing:
        """The timing of a complete run; raises ReplayError (with the stuck ranks) on a deadlock."""
        # One loop with its state in locals: a 64 x 50k-node set is ~3M passes through it.
        graphs = self.graphs
        state = [(self.pending[r], g.types, g.children, g.child_start, self.comp_ready[r], self.comm_ready[r],
                  self.recv_ready[r]) for r, g in enumerate(graphs)]
        comms, durations = [g.comm for g in graphs], self.durations
        computing, in_slot, done, busy, finish = self.computing, self.in_slot, self.done, self.busy, self.finish
        mailbox, posted, events = self.mailbox, self.posted, self.events
        issued, joined, slot_ordinal, coll_us = self.issued, self.joined, self.slot_ordinal, self.coll_us
        size = {group: len(m) for group, m in self.members.items()}
        push, pop, send_us, collective_us = heapq.heappush, heapq.heappop, self.cost.send_us, self.cost.collective_us
        changed, is_changed = list(range(len(graphs))), [True] * len(graphs)  # ranks to issue on
        # recording: per-node times of the chosen ranks; arrivals and posts per p2p key, whose
        # FIFO order is the matching (the n-th message of a key goes to its n-th posted RECV)
        starts: list[array | None] = [None] * len(graphs)
        ends: list[array | None] = [None] * len(graphs)
        for r in self.record:
            starts[r], ends[r] = array("d", bytes(8 * len(graphs[r].ids))), array("d", bytes(8 * len(graphs[r].ids)))
        arrivals: dict[CommKey, list[tuple[int, int]]] | None = defaultdict(list) if self.record else None
        posts: dict[CommKey, list[tuple[int, int]]] | None = defaultdict(list) if self.record else None

        def complete(r: int, i: int, now: float) -> None:
            done[r] += 1
            finish[r] = now
            if ends[r] is not None:
                ends[r][i] = now
            pending, types, children, start, comp_q, comm_q, recv_q = state[r]
            lo, hi = start[i], start[i + 1]
            for c in (children[lo],) if hi - lo == 1 else children[lo:hi]:
                left = pending[c] - 1
                pending[c] = left
                if not left:
                    t = types[c]
                    push(comp_q if t == COMP else recv_q if t == RECV else comm_q, c)
            if not is_changed[r]:
                is_changed[r] = True
                changed.append(r)

        def join(r: int, i: int, now: float) -> None:
            key = comms[r][i]
            group = key[0]
            k = slot_ordinal[r] = issued[r].get(group, 0)
            issued[r][group] = k + 1
            instance = joined.setdefault((group, k), [])
            instance.append((r, i))
            if len(instance) == size[group]:  # the last member joined: the collective starts
                del joined[(group, k)]
                us = coll_us.get(key)
                if us is None:
                    us = coll_us[key] = collective_us(key[1], key[2], group)
                push(events, (now + us, _COLL_DONE, instance, 0))

        now = 0.0
        while True:
            # issue: each changed rank starts its lowest ready COMP and COLL/SEND if the unit is
            # free, and posts every ready RECV
            work = changed[:]
            changed.clear()
            for r in work:
                is_changed[r] = False
                _, types, _, _, comp_q, comm_q, recv_q = state[r]
                issued_at = starts[r]
                if comp_q and not computing[r]:
                    i = pop(comp_q)
                    if issued_at is not None:
                        issued_at[i] = now
                    computing[r] = True
                    d = durations[r][i]
                    busy[r] += d
                    push(events, (now + d, _COMP_DONE, r, i))
                if comm_q and in_slot[r] < 0:
                    i = in_slot[r] = pop(comm_q)
                    if issued_at is not None:
                        issued_at[i] = now
                    if types[i] == COLL:
                        join(r, i, now)
                    else:
                        src, dst, _, nbytes = comms[r][i]
                        push(events, (now + send_us(src, dst, nbytes), _SEND_DONE, r, i))
                while recv_q:
                    i = pop(recv_q)
                    key = comms[r][i]
                    if issued_at is not None:
                        issued_at[i] = now
                    if posts is not None:
                        posts[key].append((r, i))
                    if mailbox.get(key):
                        mailbox[key] -= 1
                        push(events, (now, _RECV_DONE, r, i))
                    else:
                        posted[key].append((r, i))
            if not events:
                break
            # apply every event of the next time; those pushed meanwhile at that time go next round
            now = events[0][0]
            while events and events[0][0] == now:
                _, kind, r, i = pop(events)
                if kind == _COMP_DONE:
                    computing[r] = False
                    complete(r, i, now)
                elif kind == _COLL_DONE:
                    for m, j in r:
                        in_slot[m] = -1
                        complete(m, j, now)
                elif kind == _SEND_DONE:
                    in_slot[r] = -1
                    complete(r, i, now)
                    key = comms[r][i]
                    if arrivals is not None:
                        arrivals[key].append((r, i))
                    waiting = posted.get(key)
                    if waiting:  # the oldest RECV posted for this message completes on arrival
                        m, j = waiting.popleft()
                        complete(m, j, now)
                    else:
                        mailbox[key] += 1
                else:
                    complete(r, i, now)
        problems = self._deadlock_report()
        if problems:
            raise ReplayError("the timed replay deadlocks", problems)
        nodes = None
        if self.record:
            chosen = set(self.record)
            messages = sorted((*s, *d) for key in arrivals for s, d in zip(arrivals[key], posts[key])
                              if s[0] in chosen or d[0] in chosen)
            nodes = NodeTimes({r: graphs[r].ids for r in self.record}, {r: starts[r] for r in self.record},
                              {r: ends[r] for r in self.record}, messages)
        return Timing.of(busy, finish, nodes)

    def _slot_waiter(self, r: int) -> int | None:
        return self.comm_ready[r][0] if self.comm_ready[r] else None
