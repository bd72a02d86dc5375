"""explore's slice replay read straight from lowering's repeats, their rows never made.

A program lowered for timing is a list of Repeats (stg.program): templates, and per repeat
its template, first node id, tag shift and the nodes its dependencies name from before it.
Making its rows (the replay's ids, types, dependencies, durations and comm keys, node by
node) and laying the slice's out for the longest-path sweep (stg/chakra/longest_paths.py)
cost more than the sweep itself: a pp 16 slice of llama3-405b holds 87,000 replay nodes made
from 784 repeats of 83 templates. Here one compiled loop walks each repeat's template as the
sweep walks rows: reaching a COMP run it rounds the run's nodes on the rank's carry
(lowering's rounding, in lowering's order); a node's dependencies and its comm key come from the
template (those from before the action from the repeat's share of `outside`); then each
node ends as SlicePaths' sweep ends it -- the same additions and maxima in the same order,
the same switch to another rank where a receive's message or a collective's other members
are not in yet, the same checks -- so every time is the float the sweep finds
(tests/test_evaluate.py, the timing test). Which node comes next never depends on times, so
one pass times every cost model, a column each. Keys are translated once per distinct key
of a rank (a few tens), not per comm node; messages are matched and collectives joined as
they come, in open-addressing hash tables -- but for a collective whose group has one member
in the slice (tp, dp, cp and ep groups: their other members are copies of the slice), which
ends its slot after the rank joins it, as a joined instance of one member would.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import chain

import numba
import numpy as np

from stg.chakra.longest_paths import key_places
from stg.chakra.rank_graph import COLL, COMP, RECV
from stg.chakra.replay import CostModel, Timing
from stg.chakra.replay_kernel import slot_times
from stg.program import ReplayChunks, Repeats, plain_hole, plain_key
from stg.repeats_kernel import HEADER, rounded

TAG_LIMIT = 2**31  # a message's tag, shifted, fits 32 bits of its hash key


class RepeatPaths:
    """The timed programs of a slice (`programs`: their ReplayChunks, all Repeats; `values`:
    per program what each hole stands for, slice_check._hole_values) laid out for the sweep
    once; `runs(costs)` as SlicePaths'. `groups`: each group's member indices among these
    ranks."""

    def __init__(self, programs: Sequence[ReplayChunks], values: Sequence[Mapping],
                 groups: Mapping[int, Sequence[int]]):
        self.groups = groups
        parts = [program.repeats for program in programs]
        flat: list[Repeats] = list(chain.from_iterable(parts))
        count = lambda sizes: np.cumsum([0, *sizes], dtype=np.int64)  # noqa: E731
        self.rank_entries = count([sum(len(p.template) for p in rank) for rank in parts])
        self.rank_outside = count([sum(len(p.outside) for p in rank) for rank in parts])
        self.rank_ids = count([program.ids for program in programs])
        packed_at, exact_at, template_at = (count([len(getattr(p, name)) for p in flat])
                                            for name in ("packed", "exacts", "at"))
        self.packed = np.concatenate([p.packed for p in flat])
        self.at = np.concatenate([p.at + off for p, off in zip(flat, packed_at)])
        self.exacts = np.concatenate([p.exacts for p in flat])
        self.exact_at = np.concatenate([p.exact_at + off for p, off in zip(flat, exact_at)])
        self.template = np.concatenate([p.template + off for p, off in zip(flat, template_at)])
        self.start = np.concatenate([p.start for p in flat])
        self.shift = np.concatenate([p.shift for p in flat])
        self.outside = np.concatenate([p.outside for p in flat])
        firsts = count([len(p.template) for p in flat])[:-1]
        self.carry = np.full(len(self.template), np.nan)  # a part's first repeat: the carry it starts from
        self.carry[firsts[[len(p.template) > 0 for p in flat]]] = [p.carry for p in flat if len(p.template)]
        self._keys(parts, values)
        # the hash tables of messages and collectives: at most half full
        self.table_size = 1 << (2 * int(self.packed[self.at[self.template] + 4].sum()) + 1).bit_length()

    def _keys(self, parts: list[list[Repeats]], values: Sequence[Mapping]) -> None:
        """Each repeat's comm keys as indices into the distinct keys of the slice (key_at, by
        template; key_map), and per distinct key its slot (a collective's, a send's by its
        pair), its group's index or -1, its pair's index and its tag."""
        group_index = {group: k for k, group in enumerate(sorted(self.groups))}
        slots: dict[tuple, int] = {}
        pairs: dict[tuple, int] = {}
        places: list[tuple[int, int, int, int]] = []  # per distinct key of a rank
        key_map, key_at, offset = [], [], 0
        for rank, value in zip(parts, values):
            distinct: dict[tuple, int] = {}  # a key as plain values -> index
            of = {plain_hole(hole): v for hole, v in value.items()}  # (its keys' holes are plain too)
            for part in rank:
                key_at.append(part.key_at + offset)
                offset += len(part.keys)
                index = []
                # a group of equal keys (its template's): a slice holds thousands of keys, a few
                # hundred groups, tens of values
                for key in map(part.keys.__getitem__, part.group_first.tolist()):
                    found = distinct.get(plain := plain_key(key))
                    if found is None:
                        found = distinct[plain] = len(places)
                        translated = (of[plain[:2]], plain[2], plain[3]) if len(key) == 3 else \
                            (of[plain[0]], of[plain[1]], plain[2], plain[3])
                        places.append(key_places(translated, slots, pairs, group_index))
                    index.append(found)
                key_map.append(np.array(index, dtype=np.int64)[part.key_group])
        self.key_at = np.concatenate(key_at) if key_at else np.zeros(0, dtype=np.int64)
        self.key_map = np.concatenate(key_map) if key_map else np.zeros(0, dtype=np.int64)
        columns = np.array(places, dtype=np.int64).reshape(-1, 4).T.copy()  # (each row contiguous)
        self.key_slot, self.key_group, self.key_pair, self.key_tag = columns
        self.slot_keys = slots
        self.group_size = np.array([len(self.groups[g]) for g in sorted(self.groups)], dtype=np.int64)
        # a message's tag, shifted, within 32 bits (else the event queue replays the slice)
        self.sweeps = (np.abs(self.key_tag).max(initial=0) + np.abs(self.shift).max(initial=0) < TAG_LIMIT
                       and len(pairs) < TAG_LIMIT)

    def run(self, cost: CostModel) -> Timing | None:
        """What SlicePaths.run returns for these programs' rows."""
        return self.runs([cost])[0]

    def runs(self, costs: Sequence[CostModel]) -> list[Timing | None]:
        """run(cost) for each cost, in one sweep: which node the sweep takes next depends on
        which nodes it took (a receive waits for its send, a collective for its members),
        never on their times, so each cost's times come out as its own sweep's would."""
        if not self.sweeps:
            return [None] * len(costs)
        if len(costs) != 2:  # the sweep takes two columns (explore's free and costed runs)
            return [self.runs([cost, cost])[0] for cost in costs]
        slots = np.arange(len(self.slot_keys), dtype=np.int64)
        slot_us = np.array([slot_times(cost, self.groups, self.slot_keys, slots) for cost in costs])
        busy, finish, swept = _sweep(*_scratch(int(self.rank_ids[-1]), self.table_size, len(costs)),
                                     self.packed, self.at, self.exacts, self.exact_at, self.key_at, self.template,
                                     self.start, self.shift, self.carry, self.outside, self.rank_entries,
                                     self.rank_outside, self.rank_ids, self.key_map, self.key_slot, self.key_group,
                                     self.key_pair, self.key_tag, slot_us, self.group_size)
        busy = busy.tolist()
        return [Timing.of(busy, finish[:, c].tolist()) if swept else None for c in range(len(costs))]


_SCRATCH: dict[str, np.ndarray] = {}


def _scratch(ids: int, table_size: int, costs: int) -> tuple[np.ndarray, ...]:
    """The sweep's working arrays, kept from sweep to sweep (each a few megabytes: fresh ones
    cost more in page faults than the sweep spends in them); it sets what it reads. Times
    have a column per cost model."""
    wanted = {"ends": (ids, costs, np.float64), "messages": (table_size, 0, np.int64),
              "sent": (table_size, costs, np.float64), "received": (table_size, 0, np.bool_),
              "instances": (table_size, 0, np.int64), "joined": (table_size, 0, np.int64),
              "joined_at": (table_size, costs, np.float64), "instance_end": (table_size, costs, np.float64)}
    for name, (rows, columns, dtype) in wanted.items():
        size = rows * max(columns, 1)
        if name not in _SCRATCH or len(_SCRATCH[name]) < size:
            _SCRATCH[name] = np.empty(max(size, 2 * len(_SCRATCH.get(name, ()))), dtype=dtype)
    return tuple(_SCRATCH[name][:rows * columns].reshape(rows, columns) if columns else _SCRATCH[name][:rows]
                 for name, (rows, columns, _) in wanted.items())


@numba.njit(cache=True)
def _find(table, key):
    """Where `key` is in the open-addressing table (keys, -1 where empty), or where it would go."""
    mask = table.size - 1
    at = (((key ^ (key >> 29)) * 0x5851F42D4C957F2D) >> 24) & mask  # (the pair folded into the low bits)
    while table[at] != key and table[at] != -1:
        at = (at + 1) & mask
    return at


@numba.njit(cache=True)
def _sweep(ends, messages, sent, received, instances, joined, joined_at, instance_end, packed, at, exacts,
           exact_at, key_at, template, start, shift, carry_in, outside, rank_entries, rank_outside, rank_ids,
           key_map, key_slot, key_group, key_pair, key_tag, slot_us, group_size):
    """longest_paths._sweep over the rows the repeats make (repeats_kernel.repeated_rows), read
    from their templates as the sweep meets them, with a column of times per cost model
    (`slot_us`: a row of slot times each): per rank the COMP time, per rank and cost the last
    end, and whether every node ended without waiting for its rank's compute or comm slot. Two
    columns (RepeatPaths.runs pairs its costs)."""
    ranks, costs = rank_entries.size - 1, slot_us.shape[0]
    ends[:] = -1.0  # by node id, ranks end to end; -1: not yet
    entry = rank_entries[:-1].copy()
    node = np.zeros(ranks, np.int64)  # the next node of the rank's repeat
    flat_at = np.zeros(ranks, np.int64)  # and its first dependency among the repeat's
    entered = np.zeros(ranks, np.bool_)
    taken = rank_outside[:-1].copy()  # the next of outside to place
    carry = np.zeros(ranks)
    next_exact = np.zeros(ranks, np.int64)  # per rank: its repeat's next COMP node to round
    first_out = np.zeros(ranks, np.int64)  # and where its dependencies from before start in outside
    joining = np.zeros(ranks, np.bool_)  # the rank's next node is a collective it joined
    pending = np.zeros(ranks, np.int64)  # that collective's instance
    ordinal = np.zeros(ranks * max(group_size.size, 1), np.int64)  # collectives each rank joined, per group
    # hash tables: the (pair, tag) of each message sent, its send's end, whether received; the
    # (group, ordinal) of each collective instance, its members joined, when, and its end
    messages[:] = -1
    received[:] = False
    instances[:] = -1
    joined[:] = 0
    joined_at[:] = 0.0
    instance_end[:] = -1.0
    busy = np.zeros(ranks)
    finish, compute_free, slot_free = np.zeros((ranks, costs)), np.zeros((ranks, costs)), np.zeros((ranks, costs))
    ready = np.zeros(costs)
    left = ranks
    while left:
        moved = False
        left = 0
        for r in range(ranks):
            base = rank_ids[r]
            while entry[r] < rank_entries[r + 1]:
                e = entry[r]
                t = template[e]
                b = at[t]
                n_kept, n_flat, n_out, n_comp, n_keyed = packed[b], packed[b + 1], packed[b + 2], packed[b + 3], \
                    packed[b + 4]
                p_types = b + HEADER + n_kept
                p_deps = p_types + 2 * n_kept
                p_runs = p_deps + n_flat + n_out
                flags = p_runs + n_comp + n_keyed  # per comm node: a send or receive
                keyed_as = flags + n_keyed + packed[b + 5]  # per node: its place among the comm nodes
                s = start[e]
                if not entered[r]:
                    first_out[r] = taken[r]
                    taken[r] += n_out
                    if carry_in[e] == carry_in[e]:  # (not NaN) a part's first repeat
                        carry[r] = carry_in[e]
                    entered[r], node[r], flat_at[r], next_exact[r] = True, 0, 0, 0
                k, f = node[r], flat_at[r]
                while k < n_kept:
                    kind = packed[p_types + k]
                    n_deps = packed[p_types + n_kept + k]
                    ready0 = ready1 = 0.0  # (two columns, as scalars: the loop every dependency takes)
                    for d in range(f, f + n_deps):
                        dep = packed[p_deps + d]  # an offset in the repeat, or -1 - j: the j-th from before
                        dep = base + (dep + s if dep >= 0 else outside[first_out[r] - 1 - dep])
                        end0, end1 = ends[dep, 0], ends[dep, 1]
                        if end0 < 0:
                            return busy, finish, False  # a dependency not before it
                        if end0 > ready0:
                            ready0 = end0
                        if end1 > ready1:
                            ready1 = end1
                    ready[0], ready[1] = ready0, ready1
                    i = base + packed[b + HEADER + k] + s
                    if kind == COMP:
                        # its run's duration, as repeated_rows rounds it: the run's COMP nodes
                        # are the next in order (runs are consecutive), rounded on the carry
                        c, xi, duration = carry[r], next_exact[r], 0
                        while xi < n_comp and packed[p_runs + xi] == k:
                            d, c = rounded(exacts[exact_at[t] + xi], c)
                            duration += d
                            xi += 1
                        carry[r], next_exact[r] = c, xi
                        for x in range(costs):
                            if ready[x] < compute_free[r, x]:
                                return busy, finish, False  # it would wait for the rank's compute
                            ends[i, x] = compute_free[r, x] = ready[x] + duration
                        busy[r] += duration
                    else:
                        j = packed[keyed_as + k]
                        q = key_map[key_at[t] + j]
                        # a message: its pair and its tag, shifted to the repeat's micro-batch
                        message = (key_pair[q] << 32) | (key_tag[q] + shift[e] * packed[flags + j] + TAG_LIMIT) \
                            if kind != COLL else 0
                        if kind == RECV:
                            h = _find(messages, message)
                            if messages[h] < 0:
                                break  # its message is not in yet
                            if received[h]:
                                return busy, finish, False  # two receives of one message
                            received[h] = True
                            for x in range(costs):
                                ends[i, x] = max(ready[x], sent[h, x])
                        elif kind == COLL and group_size[key_group[q]] == 1:  # this rank's alone: no table
                            for x in range(costs):
                                if ready[x] < slot_free[r, x]:
                                    return busy, finish, False  # it would wait for the rank's comm slot
                                ends[i, x] = slot_free[r, x] = ready[x] + slot_us[x, key_slot[q]]
                        elif kind == COLL:
                            if not joining[r]:
                                for x in range(costs):
                                    if ready[x] < slot_free[r, x]:
                                        return busy, finish, False  # it would wait for the rank's comm slot
                                g = key_group[q]
                                h = _find(instances, (g << 32) | ordinal[r * group_size.size + g])
                                instances[h] = (g << 32) | ordinal[r * group_size.size + g]
                                ordinal[r * group_size.size + g] += 1
                                pending[r] = h
                                joining[r], moved = True, True
                                joined[h] += 1
                                for x in range(costs):
                                    joined_at[h, x] = max(joined_at[h, x], ready[x])
                                    if joined[h] == group_size[g]:
                                        instance_end[h, x] = joined_at[h, x] + slot_us[x, key_slot[q]]
                            h = pending[r]
                            if instance_end[h, 0] < 0:
                                break  # its other members have not joined
                            joining[r] = False
                            for x in range(costs):
                                ends[i, x] = slot_free[r, x] = instance_end[h, x]
                        else:
                            h = _find(messages, message)
                            if messages[h] >= 0:
                                return busy, finish, False  # two sends of one message
                            messages[h] = message
                            for x in range(costs):
                                if ready[x] < slot_free[r, x]:
                                    return busy, finish, False
                                ends[i, x] = slot_free[r, x] = sent[h, x] = ready[x] + slot_us[x, key_slot[q]]
                    for x in range(costs):
                        if ends[i, x] > finish[r, x]:
                            finish[r, x] = ends[i, x]
                    k += 1
                    f += n_deps
                    moved = True
                node[r], flat_at[r] = k, f
                if k < n_kept:
                    break  # stalled: the next rank
                entry[r] += 1
                entered[r] = False
            if entry[r] < rank_entries[r + 1]:
                left += 1
        if left and not moved:
            return busy, finish, False
    return busy, finish, True
