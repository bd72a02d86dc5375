"""The timed replay of programs whose compute and communication each run in one chain, as
longest paths: explore's slice replays (stg/explore/cost.py), without an event queue.

Lowering chains each rank's COMP nodes, and its COLL and SEND nodes, one after another, so no
node ever waits for a busy resource, and TimedReplay's times (stg/chakra/replay.py) are the
longest paths through the nodes: a node ends `duration` (a COMP's) or `slot` (a SEND's, a
collective's) after the latest of its dependencies; a RECV ends at the later of that and its
message's arrival; a collective's members all end `slot` after the last of them joined. Each
rank is swept in its nodes' order (an index depends on lower ones), switching rank where a
RECV's message or a collective's other members are not yet in, so every time is the float
TimedReplay finds (the same additions, the same maxima). The sweep checks what makes that so:
each COMP node, and each COLL or SEND, is ready no earlier than its rank's previous one of
its kind ended (then none ever waits for its rank's compute or comm slot, and the event
queue issues them in index order too). A sweep where one would wait, or that stalls -- a rank
whose next node waits on another rank that waits on a later node of the first, which the
event queue would run out of order -- returns None: the caller replays it with the event
queue (stg/chakra/replay_kernel.py), which also tells a deadlock. The replays of one set of
programs share the arrays (explore runs each slice twice: free and costed).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numba
import numpy as np

from stg.chakra.rank_graph import COLL, COMP, RECV, SEND
from stg.chakra.replay import CostModel, Timing
from stg.chakra.replay_kernel import slot_times
from stg.program import ReplayNodes


def key_places(key: tuple, slots: dict[tuple, int], pairs: dict[tuple, int],
               group_index: Mapping[int, int]) -> tuple[int, int, int, int]:
    """A comm key with its holes' values (a collective's (group, type, bytes), a send's or
    receive's (src, dst, tag, bytes)): its comm slot, numbered in `slots` (a collective's by
    its key, a send's by its pair), its group's index (-1: none), its pair's, numbered in
    `pairs` (-1: none), and its tag (0 for a collective)."""
    if len(key) == 3:
        return slots.setdefault((COLL, key), len(slots)), group_index[key[0]], -1, 0
    pair = (key[0], key[1], key[3])
    return slots.setdefault((SEND, pair), len(slots)), -1, pairs.setdefault(pair, len(pairs)), key[2]


class SlicePaths:
    """Rank programs (`nodes`, ReplayNodes; `keys`: per program its comm keys, comm.keys, as
    the replay numbers groups and ranks) laid out for the sweep once; `run(cost)` per cost
    model. `groups`: each group's member indices among these ranks."""

    def __init__(self, nodes: Sequence[ReplayNodes], keys: Sequence[tuple[tuple, ...]],
                 groups: Mapping[int, Sequence[int]]):
        self.groups = groups
        sizes = np.array([len(n.ids) for n in nodes], dtype=np.int64)
        self.rank_start = np.zeros(len(nodes) + 1, dtype=np.int64)
        np.cumsum(sizes, out=self.rank_start[1:])
        n = int(self.rank_start[-1])
        def joined(name: str, dtype) -> np.ndarray:  # the ranks' arrays end to end
            return np.concatenate([np.asarray(getattr(p, name), dtype=dtype) for p in nodes])

        self.types, self.durations, n_deps = joined("types", np.int64), joined("durations", np.float64), \
            joined("n_deps", np.int64)
        self.parent_start = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(n_deps, out=self.parent_start[1:])
        # False: the sweep cannot take these programs (a node depends on a later one or on none
        # of its rank's, or two messages have one key)
        self.sweeps = True
        parents = []
        for r, program in enumerate(nodes):
            parents.append(self._parents(program, n_deps[self.rank_start[r]:self.rank_start[r + 1]]))
            parents[-1] += self.rank_start[r]
        self.parents = np.concatenate(parents)
        self._comm(nodes, keys)

    def _parents(self, program: ReplayNodes, n_deps: np.ndarray) -> np.ndarray:
        """The program's dependencies as indices of its own nodes."""
        ids, deps = np.asarray(program.ids, dtype=np.int64), np.asarray(program.deps, dtype=np.int64)
        if not len(deps):
            return deps
        if (ids[1:] <= ids[:-1]).any() or deps.min() < 0 or deps.max() > ids[-1]:
            self.sweeps = False
            return np.zeros(len(deps), dtype=np.int64)
        index = np.full(int(ids[-1]) + 1, -1, dtype=np.int64)
        index[ids] = np.arange(len(ids))
        parents = index[deps]
        if ((parents < 0) | (parents >= np.repeat(np.arange(len(ids)), n_deps))).any():
            self.sweeps = False
        return parents

    def _comm(self, nodes: Sequence[ReplayNodes], keys: Sequence[tuple[tuple, ...]]) -> None:
        """Per node: the comm slot's cost it takes (slot_key), the SEND whose message a RECV
        receives (partner), the collective instance it joins (instance: the k-th of its group
        on its rank joins every member's k-th). Each distinct key is read once, the nodes
        mapped as arrays (a slice holds 10^5-10^6 comm nodes, a few hundred keys a rank)."""
        n = int(self.rank_start[-1])
        self.slot_key = np.full(n, -1, dtype=np.int64)
        self.slot_keys: dict[tuple, int] = {}
        self.partner = np.full(n, -1, dtype=np.int64)
        self.instance = np.full(n, -1, dtype=np.int64)
        group_index = {group: k for k, group in enumerate(sorted(self.groups))}
        pairs: dict[tuple, int] = {}  # (src, dst, bytes) of a message
        slots = self.slot_keys
        p2p, collectives = [], []  # per rank: (nodes, pair, tag, is a send) and (nodes, group indices)
        for r, (program, translated) in enumerate(zip(nodes, keys)):
            comm = program.comm
            at = comm.at + self.rank_start[r]
            # per key: its slot (a collective's; a send's, by its pair), its group index (a
            # collective's) or its pair, and its tag
            slot, which, tag = [], [], []
            for key in translated:
                s, group, pair, t = key_places(key, slots, pairs, group_index)
                slot.append(s)
                which.append(group if len(key) == 3 else pair)
                tag.append(t)
            slot_of = np.array(slot, dtype=np.int64)[comm.key]
            which_of = np.array(which, dtype=np.int64)[comm.key]
            kinds = self.types[at]
            holds = kinds != RECV  # a RECV holds no slot
            self.slot_key[at[holds]] = slot_of[holds]
            is_coll = kinds == COLL
            collectives.append((at[is_coll], which_of[is_coll]))
            p2p_tags = (np.array(tag, dtype=np.int64)[comm.key] + comm.shift)[~is_coll]
            p2p.append((at[~is_coll], which_of[~is_coll], p2p_tags, kinds[~is_coll] == SEND))
        # a message's SEND and RECV; two messages of one key are FIFO matching, the event queue's
        at, pair, tag, sending = (np.concatenate(parts) for parts in zip(*p2p))
        _, message = np.unique(pair * (int(tag.max(initial=0)) + 1) + tag, return_inverse=True)
        sender = np.full(len(at), -1, dtype=np.int64)
        sender[message[sending]] = at[sending]
        self.partner[at[~sending]] = sender[message[~sending]]
        if (np.bincount(message[sending]) > 1).any() or (np.bincount(message[~sending]) > 1).any():
            self.sweeps = False
        # the k-th collective of a group on each rank: one instance (group x k)
        most = max((int(np.bincount(g).max()) for _, g in collectives if len(g)), default=1)
        for at, group in collectives:
            order = np.argsort(group, kind="stable")
            first = np.searchsorted(group[order], group[order])
            ordinal = np.empty(len(at), dtype=np.int64)
            ordinal[order] = np.arange(len(at)) - first
            self.instance[at] = group * most + ordinal
        sizes = np.array([len(self.groups[g]) for g in sorted(self.groups)], dtype=np.int64)
        self.instance_size = np.repeat(sizes, most) if len(sizes) else np.zeros(1, dtype=np.int64)

    def runs(self, costs: Sequence[CostModel]) -> list[Timing | None]:
        """run(cost) for each cost."""
        return [self.run(cost) for cost in costs]

    def run(self, cost: CostModel) -> Timing | None:
        """What TimedReplay(graphs, groups, durations, cost).run() returns (without recorded
        nodes), or None when a node would wait for a busy resource or the sweep stalls (the
        event queue then decides)."""
        if not self.sweeps:
            return None
        slot_us = slot_times(cost, self.groups, self.slot_keys, self.slot_key)
        busy, finish, swept = _sweep(self.types, self.durations, slot_us, self.parent_start, self.parents,
                                     self.partner, self.instance, self.instance_size, self.rank_start)
        return Timing.of(busy.tolist(), finish.tolist()) if swept else None


@numba.njit(cache=True)
def _ready(i, parent_start, parents, ends):
    """When node i's last dependency ended."""
    ready = 0.0
    for e in range(parent_start[i], parent_start[i + 1]):
        t = ends[parents[e]]
        if t > ready:
            ready = t
    return ready


@numba.njit(cache=True)
def _sweep(types, durations, slot_us, parent_start, parents, partner, instance, instance_size, rank_start):
    """Each node's end, rank by rank in index order (see the module's docstring): per rank the
    COMP time and the last end, and whether every node ended without waiting for its rank's
    compute or comm slot."""
    n, ranks = types.size, rank_start.size - 1
    ends = np.full(n, -1.0)  # -1: not yet
    joined = np.zeros(instance_size.size, dtype=np.int64)
    joined_at = np.zeros(instance_size.size)
    instance_end = np.full(instance_size.size, -1.0)
    joining = np.zeros(ranks, dtype=np.bool_)  # the rank's next node is a collective it joined
    cursor = rank_start[:-1].copy()
    busy, finish = np.zeros(ranks), np.zeros(ranks)
    compute_free, slot_free = np.zeros(ranks), np.zeros(ranks)  # when the rank's last COMP, COLL or SEND ended
    left = n
    while left:
        moved = False
        for r in range(ranks):
            i, last = cursor[r], rank_start[r + 1]
            while i < last:
                kind = types[i]
                if kind == COMP:
                    ready = _ready(i, parent_start, parents, ends)
                    if ready < compute_free[r]:
                        return busy, finish, False  # it would wait for the rank's compute
                    end = compute_free[r] = ready + durations[i]
                    busy[r] += durations[i]
                elif kind == RECV:
                    sent = partner[i]
                    if sent < 0 or ends[sent] < 0:
                        break  # its message is not in yet
                    end = max(_ready(i, parent_start, parents, ends), ends[sent])
                elif kind == COLL:
                    k = instance[i]
                    if not joining[r]:
                        ready = _ready(i, parent_start, parents, ends)
                        if ready < slot_free[r]:
                            return busy, finish, False  # it would wait for the rank's comm slot
                        joining[r], moved = True, True
                        joined_at[k] = max(joined_at[k], ready)
                        joined[k] += 1
                        if joined[k] == instance_size[k]:
                            instance_end[k] = joined_at[k] + slot_us[i]
                    if instance_end[k] < 0:
                        break  # its other members have not joined
                    joining[r] = False
                    end = slot_free[r] = instance_end[k]
                else:
                    ready = _ready(i, parent_start, parents, ends)
                    if ready < slot_free[r]:
                        return busy, finish, False
                    end = slot_free[r] = ready + slot_us[i]
                ends[i] = end
                if end > finish[r]:
                    finish[r] = end
                i += 1
                left -= 1
                moved = True
            cursor[r] = i
        if not moved:
            return busy, finish, False
    return busy, finish, True
