"""TimedReplay's run, compiled: the same rules, the same numbers, for the replays that explore runs
by the thousand (stg/explore/cost.py) and `stg validate --timed` of a big set.

TimedReplay (stg/chakra/replay.py) is the reference and the only one that reports a deadlock or
records per-node times. This is its event loop over flat arrays, compiled with numba: every
rank's nodes numbered on in one index space, each ready queue and the event queue a binary heap
in an array, communication times computed per node before the run by the same cost model. The
order of events and of issues is TimedReplay's (events by (time, kind, rank, index), a
collective's completion by its first member's rank and index; ranks issue in the order they
changed), so every time is the same float. A run that does not finish returns None: the caller
replays it with TimedReplay for the report.

Replay's zero-time run is compiled alike (`CompiledReplay.completes`), for the big sets that
`stg validate` checks: its worklist of ranks, per-rank heaps and comm slot step for step, so
it completes exactly when Replay finds no deadlock (Replay alone says why one does not).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from array import array
from itertools import compress

import numpy as np

from stg.chakra import et_def_pb2 as pb
from stg.chakra.rank_graph import COLL, COMP, RECV, RankGraph
from stg.chakra.replay import CostModel, Timing

import numba

_SEND = pb.COMM_SEND_NODE
_COMP_DONE, _SEND_DONE, _RECV_DONE, _COLL_DONE = range(4)


def _matching(n, ranks, n_groups, n_keys, max_instances, max_members):
    """What both loops match communication with: per rank and group, the collectives issued;
    per collective instance (group x ordinal), its members so far; per p2p message key, the
    messages deposited and a FIFO of the RECVs posted for it (by node)."""
    issued = np.zeros((ranks, n_groups), dtype=np.int64)
    joined = np.zeros(n_groups * max_instances, dtype=np.int64)
    members = np.empty((max(1, n_groups * max_instances), max_members), dtype=np.int64)
    mailbox = np.zeros(n_keys, dtype=np.int64)
    posted_first = np.full(n_keys, -1, dtype=np.int64)
    posted_last = np.full(n_keys, -1, dtype=np.int64)
    posted_next = np.full(n, -1, dtype=np.int64)
    return issued, joined, members, mailbox, posted_first, posted_last, posted_next


def _kernel(types, durations, child_start, children, pending, rank_of, rank_start, slot_us, group_of, p2p_key,
            group_size, n_keys, max_instances, max_members):
    n, ranks, n_groups = len(types), len(rank_start) - 1, len(group_size)
    # ready queues: per rank one heap each for COMP, COLL/SEND and RECV nodes, in its index range
    heaps = np.empty((3, n), dtype=np.int64)
    heap_size = np.zeros((3, ranks), dtype=np.int64)
    # events: a heap of indices into (time, kind, a, b, node) rows
    cap = 2 * n + 1
    ev_time = np.empty(cap)
    ev_kind = np.empty(cap, dtype=np.int64)
    ev_a = np.empty(cap, dtype=np.int64)
    ev_b = np.empty(cap, dtype=np.int64)
    ev_node = np.empty(cap, dtype=np.int64)
    ev_heap = np.empty(cap, dtype=np.int64)
    ev_rows, ev_size = 0, 0
    computing = np.zeros(ranks, dtype=np.bool_)
    in_slot = np.full(ranks, -1, dtype=np.int64)
    done = np.zeros(ranks, dtype=np.int64)
    busy = np.zeros(ranks)
    finish = np.zeros(ranks)
    issued, joined, members, mailbox, posted_first, posted_last, posted_next = _matching(
        n, ranks, n_groups, n_keys, max_instances, max_members)
    changed = np.empty(ranks, dtype=np.int64)
    is_changed = np.zeros(ranks, dtype=np.bool_)
    work = np.empty(ranks, dtype=np.int64)

    for i in range(n):
        if pending[i] == 0:  # ascending: each heap is already in order
            t, r = types[i], rank_of[i]
            q = 0 if t == COMP else 2 if t == RECV else 1
            heaps[q, rank_start[r] + heap_size[q, r]] = i
            heap_size[q, r] += 1
    n_changed = ranks
    for r in range(ranks):
        changed[r] = r
        is_changed[r] = True

    now = 0.0
    while True:
        count = n_changed
        for c in range(count):
            work[c] = changed[c]
        n_changed = 0
        for c in range(count):
            r = work[c]
            is_changed[r] = False
            base = rank_start[r]
            if heap_size[0, r] and not computing[r]:
                i = _pop(heaps[0], base, heap_size, 0, r)
                computing[r] = True
                d = durations[i]
                busy[r] += d
                ev_rows, ev_size = _push_event(ev_time, ev_kind, ev_a, ev_b, ev_node, ev_heap, ev_rows, ev_size,
                                               now + d, _COMP_DONE, r, i - base, i)
            if heap_size[1, r] and in_slot[r] < 0:
                i = _pop(heaps[1], base, heap_size, 1, r)
                in_slot[r] = i
                if types[i] == COLL:
                    g = group_of[i]
                    k = issued[r, g]
                    issued[r, g] = k + 1
                    inst = g * max_instances + k
                    members[inst, joined[inst]] = i
                    joined[inst] += 1
                    if joined[inst] == group_size[g]:
                        first = members[inst, 0]
                        ev_rows, ev_size = _push_event(ev_time, ev_kind, ev_a, ev_b, ev_node, ev_heap, ev_rows,
                                                       ev_size, now + slot_us[i], _COLL_DONE, rank_of[first],
                                                       first - rank_start[rank_of[first]], inst)
                else:
                    ev_rows, ev_size = _push_event(ev_time, ev_kind, ev_a, ev_b, ev_node, ev_heap, ev_rows, ev_size,
                                                   now + slot_us[i], _SEND_DONE, r, i - base, i)
            while heap_size[2, r]:
                i = _pop(heaps[2], base, heap_size, 2, r)
                key = p2p_key[i]
                if mailbox[key]:
                    mailbox[key] -= 1
                    ev_rows, ev_size = _push_event(ev_time, ev_kind, ev_a, ev_b, ev_node, ev_heap, ev_rows, ev_size,
                                                   now, _RECV_DONE, r, i - base, i)
                elif posted_last[key] < 0:
                    posted_first[key] = posted_last[key] = i
                else:
                    posted_next[posted_last[key]] = i
                    posted_last[key] = i
        if ev_size == 0:
            break
        now = ev_time[ev_heap[0]]
        while ev_size and ev_time[ev_heap[0]] == now:
            row = ev_heap[0]
            ev_size = _pop_event(ev_time, ev_kind, ev_a, ev_b, ev_heap, ev_size)
            kind, node = ev_kind[row], ev_node[row]
            if kind == _COLL_DONE:
                for m in range(joined[node]):
                    j = members[node, m]
                    in_slot[rank_of[j]] = -1
                    n_changed = _complete(j, now, rank_of, types, child_start, children, pending, heaps, heap_size,
                                          rank_start, done, finish, changed, is_changed, n_changed)
                continue
            r = rank_of[node]
            if kind == _COMP_DONE:
                computing[r] = False
            elif kind == _SEND_DONE:
                in_slot[r] = -1
            n_changed = _complete(node, now, rank_of, types, child_start, children, pending, heaps, heap_size,
                                  rank_start, done, finish, changed, is_changed, n_changed)
            if kind == _SEND_DONE:
                key = p2p_key[node]
                j = posted_first[key]
                if j >= 0:  # the oldest RECV posted for this message completes on arrival
                    posted_first[key] = posted_next[j]
                    if posted_first[key] < 0:
                        posted_last[key] = -1
                    n_changed = _complete(j, now, rank_of, types, child_start, children, pending, heaps, heap_size,
                                          rank_start, done, finish, changed, is_changed, n_changed)
                else:
                    mailbox[key] += 1
    return busy, finish, done


def _complete(i, now, rank_of, types, child_start, children, pending, heaps, heap_size, rank_start, done, finish,
              changed, is_changed, n_changed):
    r = rank_of[i]
    done[r] += 1
    finish[r] = now
    for e in range(child_start[i], child_start[i + 1]):
        c = children[e]
        pending[c] -= 1
        if pending[c] == 0:
            t = types[c]
            q = 0 if t == COMP else 2 if t == RECV else 1
            _push(heaps[q], rank_start[r], heap_size, q, r, c)
    if not is_changed[r]:
        is_changed[r] = True
        changed[n_changed] = r
        n_changed += 1
    return n_changed


def _push(heap, base, heap_size, q, r, value):
    at = heap_size[q, r]
    heap_size[q, r] = at + 1
    while at > 0:
        parent = (at - 1) >> 1
        if heap[base + parent] <= value:
            break
        heap[base + at] = heap[base + parent]
        at = parent
    heap[base + at] = value


def _pop(heap, base, heap_size, q, r):
    top = heap[base]
    size = heap_size[q, r] - 1
    heap_size[q, r] = size
    if size == 0:
        return top
    value = heap[base + size]
    at = 0
    while True:
        child = 2 * at + 1
        if child >= size:
            break
        if child + 1 < size and heap[base + child + 1] < heap[base + child]:
            child += 1
        if heap[base + child] >= value:
            break
        heap[base + at] = heap[base + child]
        at = child
    heap[base + at] = value
    return top


def _event_less(ev_time, ev_kind, ev_a, ev_b, x, y):
    if ev_time[x] != ev_time[y]:
        return ev_time[x] < ev_time[y]
    if ev_kind[x] != ev_kind[y]:
        return ev_kind[x] < ev_kind[y]
    if ev_a[x] != ev_a[y]:
        return ev_a[x] < ev_a[y]
    return ev_b[x] < ev_b[y]


def _push_event(ev_time, ev_kind, ev_a, ev_b, ev_node, ev_heap, rows, size, time, kind, a, b, node):
    row = rows
    ev_time[row], ev_kind[row], ev_a[row], ev_b[row], ev_node[row] = time, kind, a, b, node
    at = size
    while at > 0:
        parent = (at - 1) >> 1
        if not _event_less(ev_time, ev_kind, ev_a, ev_b, row, ev_heap[parent]):
            break
        ev_heap[at] = ev_heap[parent]
        at = parent
    ev_heap[at] = row
    return rows + 1, size + 1


def _pop_event(ev_time, ev_kind, ev_a, ev_b, ev_heap, size):
    size -= 1
    if size == 0:
        return 0
    row = ev_heap[size]
    at = 0
    while True:
        child = 2 * at + 1
        if child >= size:
            break
        if child + 1 < size and _event_less(ev_time, ev_kind, ev_a, ev_b, ev_heap[child + 1], ev_heap[child]):
            child += 1
        if not _event_less(ev_time, ev_kind, ev_a, ev_b, ev_heap[child], row):
            break
        ev_heap[at] = ev_heap[child]
        at = child
    ev_heap[at] = row
    return size


def _logical(types, child_start, children, pending, rank_of, rank_start, group_of, p2p_key, group_size, n_keys,
             max_instances, max_members):
    """Replay's zero-time run (stg/chakra/replay.py), step for step: a worklist of ranks in the
    order they were woken; per rank the lowest-id issuable ready node first, a COLL or SEND
    behind a busy comm slot waiting in a second heap; a SEND deposits at once, a COLL holds the
    slot until every member joined. How many nodes of each rank completed."""
    n, ranks, n_groups = len(types), len(rank_start) - 1, len(group_size)
    heaps = np.empty((2, n), dtype=np.int64)  # per rank: ready nodes, and those waiting for the slot
    heap_size = np.zeros((2, ranks), dtype=np.int64)
    in_slot = np.full(ranks, -1, dtype=np.int64)
    done = np.zeros(ranks, dtype=np.int64)
    issued, joined, members, mailbox, posted_first, posted_last, posted_next = _matching(
        n, ranks, n_groups, n_keys, max_instances, max_members)
    work = np.arange(ranks, dtype=np.int64)  # a ring: a rank is queued at most once
    queued = np.ones(ranks, dtype=np.bool_)
    head, queue = 0, ranks
    for i in range(n):
        if pending[i] == 0:  # ascending: each heap is already in order
            r = rank_of[i]
            heaps[0, rank_start[r] + heap_size[0, r]] = i
            heap_size[0, r] += 1
    while queue:
        r = work[head]
        head = (head + 1) % ranks
        queue -= 1
        queued[r] = False
        base = rank_start[r]
        while True:
            if heap_size[1, r] and in_slot[r] < 0 and (heap_size[0, r] == 0 or heaps[1, base] < heaps[0, base]):
                i = _pop(heaps[1], base, heap_size, 1, r)
            elif heap_size[0, r]:
                i = _pop(heaps[0], base, heap_size, 0, r)
            else:
                break
            t = types[i]
            if t == RECV:
                key = p2p_key[i]
                if mailbox[key] == 0:  # posted: the SEND that deposits this message completes it
                    if posted_last[key] < 0:
                        posted_first[key] = i
                    else:
                        posted_next[posted_last[key]] = i
                    posted_last[key] = i
                    continue
                mailbox[key] -= 1
            elif t != COMP:
                if in_slot[r] >= 0:
                    _push(heaps[1], base, heap_size, 1, r, i)
                    continue
                if t == COLL:
                    g = group_of[i]
                    k = issued[r, g]
                    issued[r, g] = k + 1
                    in_slot[r] = i
                    inst = g * max_instances + k
                    members[inst, joined[inst]] = i
                    joined[inst] += 1
                    if joined[inst] == group_size[g]:
                        for m in range(joined[inst]):
                            j = members[inst, m]
                            owner = rank_of[j]
                            in_slot[owner] = -1
                            _finish(j, owner, types, child_start, children, pending, heaps, heap_size, rank_start, done)
                            if owner != r and not queued[owner]:
                                queued[owner] = True
                                work[(head + queue) % ranks] = owner
                                queue += 1
                    continue
                key = p2p_key[i]  # a SEND: eager
                j = posted_first[key]
                if j >= 0:
                    posted_first[key] = posted_next[j]
                    if posted_first[key] < 0:
                        posted_last[key] = -1
                    owner = rank_of[j]
                    _finish(j, owner, types, child_start, children, pending, heaps, heap_size, rank_start, done)
                    if not queued[owner]:
                        queued[owner] = True
                        work[(head + queue) % ranks] = owner
                        queue += 1
                else:
                    mailbox[key] += 1
            _finish(i, r, types, child_start, children, pending, heaps, heap_size, rank_start, done)
    return done


def _finish(i, r, types, child_start, children, pending, heaps, heap_size, rank_start, done):
    """Node i of rank r completes: its children with no other pending parent become ready."""
    done[r] += 1
    for e in range(child_start[i], child_start[i + 1]):
        c = children[e]
        pending[c] -= 1
        if pending[c] == 0:
            _push(heaps[0], rank_start[r], heap_size, 0, r, c)


# compiled once per installation (numba's cache beside this file); loading it takes ~0.1 s
_jit = numba.njit(cache=True)
(_matching, _push, _pop, _event_less, _push_event, _pop_event, _complete, _kernel, _finish, _logical) = map(
    _jit, (_matching, _push, _pop, _event_less, _push_event, _pop_event, _complete, _kernel, _finish, _logical))


class CompiledReplay:
    """A set of rank graphs laid out for the compiled run, once; `run(cost)` for each cost model
    (explore replays a slice twice: free and on its network)."""

    def __init__(self, graphs: list[RankGraph], groups: Mapping[int, Sequence[int]], durations: list[array]):
        self.groups = groups
        self.sizes = np.array([len(g.ids) for g in graphs], dtype=np.int64)
        self.rank_start = np.zeros(len(graphs) + 1, dtype=np.int64)
        np.cumsum(self.sizes, out=self.rank_start[1:])
        n = int(self.rank_start[-1])
        self.types = np.frombuffer(b"".join(g.types for g in graphs), dtype=np.uint8).astype(np.int64)
        self.child_start = np.empty(n + 1, dtype=np.int64)
        children, edges = [], 0
        for r, g in enumerate(graphs):
            starts = np.frombuffer(g.child_start, dtype=np.int64)
            self.child_start[self.rank_start[r]:self.rank_start[r + 1]] = starts[:-1] + edges
            children.append(np.frombuffer(g.children, dtype=np.int64) + self.rank_start[r])
            edges += int(starts[-1])
        self.child_start[n] = edges
        self.children = np.concatenate(children) if children else np.empty(0, dtype=np.int64)
        self.pending = np.concatenate([np.frombuffer(g.n_parents, dtype=np.int64) for g in graphs]) if graphs \
            else np.empty(0, dtype=np.int64)
        self.rank_of = np.repeat(np.arange(len(graphs), dtype=np.int64), self.sizes)
        self.durations = np.concatenate([np.frombuffer(d, dtype=np.float64) for d in durations]) if durations \
            else np.empty(0)
        group_index = {group: k for k, group in enumerate(sorted(groups))}
        self.group_size = np.array([len(groups[g]) for g in sorted(groups)], dtype=np.int64)
        self.group_of = np.zeros(n, dtype=np.int64)
        self.p2p_key = np.zeros(n, dtype=np.int64)
        # each node holding the comm slot costs what its distinct (kind, key) costs
        self.slot_key = np.full(n, -1, dtype=np.int64)
        self.slot_keys: dict[tuple, int] = {}
        keys: dict[tuple, int] = {}
        per_group = np.zeros((len(graphs), max(1, len(groups))), dtype=np.int64)
        slots = self.slot_keys
        for r, g in enumerate(graphs):  # a slice holds 10^5-10^6 comm nodes: one pass each, then arrays
            at = np.fromiter(g.comm, dtype=np.int64, count=len(g.comm))
            kinds = np.frombuffer(g.types, dtype=np.uint8)[at]
            is_coll = kinds == COLL
            colls = list(compress(g.comm.values(), is_coll.tolist()))
            p2ps = list(compress(g.comm.values(), (~is_coll).tolist()))
            at_coll, at_p2p = at[is_coll] + self.rank_start[r], at[~is_coll] + self.rank_start[r]
            # a program's collectives share a few key objects: each distinct one looked up once
            idents = list(map(id, colls))
            distinct = dict(zip(idents, colls))
            slot_of = {ident: slots.setdefault((COLL, key), len(slots)) for ident, key in distinct.items()}
            group_of = {ident: group_index[key[0]] for ident, key in distinct.items()}
            self.slot_key[at_coll] = list(map(slot_of.__getitem__, idents))
            group = np.array(list(map(group_of.__getitem__, idents)), dtype=np.int64)
            self.group_of[at_coll] = group
            per_group[r] = np.bincount(group, minlength=per_group.shape[1])
            self.p2p_key[at_p2p] = [keys.setdefault(key, len(keys)) for key in p2ps]
            sends = kinds[~is_coll] == _SEND
            self.slot_key[at_p2p[sends]] = [slots.setdefault((_SEND, (key[0], key[1], key[3])), len(slots))
                                            for key in compress(p2ps, sends.tolist())]
        self.n_keys = max(1, len(keys))
        self.max_instances = max(1, int(per_group.max()))

    def completes(self) -> bool:
        """Whether Replay(graphs, groups).run() finds no deadlock (it alone says why)."""
        done = _logical(self.types, self.child_start, self.children, self.pending.copy(), self.rank_of,
                        self.rank_start, self.group_of, self.p2p_key, self.group_size, self.n_keys,
                        self.max_instances, max(1, int(self.group_size.max(initial=1))))
        return bool((done == self.sizes).all())

    def run(self, cost: CostModel) -> Timing | None:
        """What TimedReplay(graphs, groups, durations, cost).run() returns (without recorded
        nodes), or None when the run does not finish."""
        slot_us = slot_times(cost, self.groups, self.slot_keys, self.slot_key)
        busy, finish, done = _kernel(self.types, self.durations, self.child_start, self.children, self.pending.copy(),
                                     self.rank_of, self.rank_start, slot_us, self.group_of, self.p2p_key,
                                     self.group_size, self.n_keys, self.max_instances,
                                     max(1, int(self.group_size.max(initial=1))))
        if (done != self.sizes).any():
            return None
        return Timing.of(busy.tolist(), finish.tolist())


def slot_times(cost: CostModel, groups: Mapping[int, Sequence[int]], slot_keys: Mapping[tuple, int],
               slot_key: np.ndarray) -> np.ndarray:
    """Per node, how long it holds its rank's comm slot under `cost`: each distinct (kind,
    key) of `slot_keys` -- (COLL, (group, type, bytes)), (SEND, (src, dst, bytes)) -- costed once,
    `slot_key` its index per node (-1: holds no slot, 0 µs)."""
    bound = cost.bind(groups)
    costs = [bound.collective_us(key[1], key[2], key[0]) if kind == COLL else bound.send_us(*key)
             for kind, key in slot_keys]
    return np.append(np.array(costs, dtype=np.float64), 0.0)[slot_key]
