"""flush_compact's loop compiled (stg/repeats.py): the replay rows of a run of repeated actions,
each a template's rows shifted to where the repeat starts, its COMP runs' durations rounded
on the running carry in order. A long pipeline's timing build flushes thousands of repeats a
stage; done template by template in numpy it cost a tenth of explore's time in small calls.

A template is packed once into one int64 array (_Compact.packed): six counts -- kept nodes K,
flat dependencies D, dependencies from before the action O, COMP nodes E, keyed comm nodes Q,
comm nodes M -- then its kept offsets, types and dependency counts (K each), its flat
dependencies (D, offsets within the action; the j-th from before -1 - j), where among them
those from before go (O), each COMP node's run (E), its keyed comm nodes' kept indices and
whether each is a send or receive (Q each), its comm nodes' offsets (M), and each kept
node's place among the keyed ones, -1 if none (K)."""

from __future__ import annotations

import numba
import numpy as np

HEADER = 6


@numba.njit(cache=True, inline="always")
def rounded(exact, carry):
    """Lowering's rounding of a COMP node's duration (stg.lower._ProgramBuilder._rounded, and
    inline in stg/repeats.py _replay_nodes): its whole microseconds and the error carried on,
    the same in every compiled loop that rounds (their times match to the last bit)."""
    exact += carry
    # np.rint rounds half to even, as Python's round does, in one instruction (round's own
    # compiled form costs a third of the repeats' sweep)
    duration = np.int64(np.rint(exact)) if exact > 0 else np.int64(0)
    return duration, exact - duration


@numba.njit(cache=True)
def repeated_rows(packed, at, exacts, exact_at, template, start, shift, outside, key_at, carry):
    """The rows of the repeats (entry e: template[e], its packed block at at[template[e]], its
    exacts from exact_at[template[e]], its first node id start[e], its tags shifted by
    shift[e], its dependencies from before next in `outside`, its keys from key_at[template[e]]
    in the chunk's): ids, types, n_deps, deps, each row's rounded duration, the carry after,
    and the keyed comm nodes' rows, keys and tag shifts, and the comm nodes' ids."""
    rows = flat = keyed = comm = 0
    for e in range(template.size):
        b = at[template[e]]
        rows += packed[b]
        flat += packed[b + 1]
        keyed += packed[b + 4]
        comm += packed[b + 5]
    ids, types, n_deps = np.empty(rows, np.int64), np.empty(rows, np.int64), np.empty(rows, np.int64)
    deps, sums = np.empty(flat, np.int64), np.zeros(rows, np.int64)
    comm_at, comm_key, comm_shift = np.empty(keyed, np.int64), np.empty(keyed, np.int64), np.empty(keyed, np.int64)
    comm_ids = np.empty(comm, np.int64)
    row = fl = q = m = o = 0
    for e in range(template.size):
        t, s = template[e], start[e]
        b = at[t]
        n_kept, n_flat, n_out, n_comp, n_keyed, n_comm = (packed[b], packed[b + 1], packed[b + 2], packed[b + 3],
                                                         packed[b + 4], packed[b + 5])
        p = b + HEADER
        for k in range(n_kept):
            ids[row + k] = packed[p + k] + s
            types[row + k] = packed[p + n_kept + k]
            n_deps[row + k] = packed[p + 2 * n_kept + k]
        p += 3 * n_kept
        for d in range(n_flat):
            deps[fl + d] = packed[p + d] + s
        p += n_flat
        for j in range(n_out):
            deps[fl + packed[p + j]] = outside[o + j]
        p += n_out
        x0 = exact_at[t]
        for i in range(n_comp):  # in order
            duration, carry = rounded(exacts[x0 + i], carry)
            sums[row + packed[p + i]] += duration
        p += n_comp
        for j in range(n_keyed):
            comm_at[q + j] = packed[p + j] + row
            comm_key[q + j] = key_at[t] + j
            comm_shift[q + j] = shift[e] * packed[p + n_keyed + j]
        p += 2 * n_keyed
        for j in range(n_comm):
            comm_ids[m + j] = packed[p + j] + s
        row += n_kept
        fl += n_flat
        o += n_out
        q += n_keyed
        m += n_comm
    return ids, types, n_deps, deps, sums, carry, comm_at, comm_key, comm_shift, comm_ids


@numba.njit(cache=True)
def carried(packed, at, exacts, exact_at, template, start, carry):
    """What repeated_rows gives of the repeats without their rows: the carry after their COMP
    runs are rounded in order, and the comm nodes' ids."""
    comm = 0
    for e in range(template.size):
        comm += packed[at[template[e]] + 5]
    comm_ids = np.empty(comm, np.int64)
    m = 0
    for e in range(template.size):
        t = template[e]
        b = at[t]
        n_kept, n_flat, n_out, n_comp, n_keyed, n_comm = (packed[b], packed[b + 1], packed[b + 2], packed[b + 3],
                                                         packed[b + 4], packed[b + 5])
        x0 = exact_at[t]
        for i in range(n_comp):
            carry = rounded(exacts[x0 + i], carry)[1]
        p = b + HEADER + 3 * n_kept + n_flat + n_out + n_comp + 2 * n_keyed
        for j in range(n_comm):
            comm_ids[m + j] = packed[p + j] + start[e]
        m += n_comm
    return carry, comm_ids
