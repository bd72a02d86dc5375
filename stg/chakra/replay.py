"""A zero-time replay of all ranks together under ASTRA-sim's issue rules: does the set wedge?"""

from __future__ import annotations

import heapq
from array import array
from collections import Counter, defaultdict, deque

from stg.chakra.rank_graph import COLL, COMP, RECV, CommKey, Problem, RankGraph, coll_name, group_label, p2p_text, type_name

MAX_DEADLOCK_LINES = 10


class Replay:
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
            if self.slot_wait[r]:
                w = self.slot_wait[r][0]
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
