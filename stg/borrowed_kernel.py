"""stg/borrowed.py's loop compiled: a stage's repeated actions wired by role, all at once.

Each template is packed once (stg/borrowed.py, _packed) into one int64 array: nine counts --
its nodes N, its compute and comm chains' last node (offsets, -1: none), its role sets S and
their roles R, its dependencies from before it O, the tensors it makes T, its other exits X
and its merged runs' tails L -- then per set its role count (S), the roles' kinds and places
(R each), per dependency its set (-1: the compute chain's last node before it) (O), the
tensors' places and offsets (T each), the other exits' kinds, places, whether their node is
one of its own (0) or a set's (1), and that offset or set (X each), and the tails and their
runs' first nodes (L each)."""

from __future__ import annotations

import numba
import numpy as np

from stg.borrowed import COMM, COMPUTE, HEADER, PREFETCH, TENSOR


@numba.njit(cache=True)
def wired(packed, at, order, rows, m, places, phases, nodes):
    """For the actions in `order` (template indices; `rows`: each one's micro-batch, m for the
    step, which reads the latest producer of each tensor over all micro-batches): where each
    one's nodes start, the nodes its dependencies from before it name (each merged run's first),
    in order, and whether every role resolved to one node (ActionNodes._resolve's rule)."""
    here = np.full((m + 1, places), -1, dtype=np.int64)
    prefetch = np.full(phases, -1, dtype=np.int64)
    head = np.arange(nodes)
    starts = np.empty(order.size, dtype=np.int64)
    total = 0
    for e in range(order.size):
        total += packed[at[order[e]] + 5]
    outside = np.empty(total, dtype=np.int64)
    resolved = np.empty(64, dtype=np.int64)
    last_compute = last_comm = -1
    cursor = o = 0
    for e in range(order.size):
        b, mb = at[order[e]], rows[e]
        if mb == m:  # the step: each tensor's producer in the latest micro-batch that made it
            for r in range(m):
                for p in range(places):
                    if here[r, p] >= 0:
                        here[m, p] = here[r, p]
        size, lc, lm, n_sets, n_roles = packed[b], packed[b + 1], packed[b + 2], packed[b + 3], packed[b + 4]
        n_out, n_made, n_other, n_tails = packed[b + 5], packed[b + 6], packed[b + 7], packed[b + 8]
        if n_sets > resolved.size:
            resolved = np.empty(n_sets, dtype=np.int64)
        counts = b + HEADER
        kinds = counts + n_sets
        ids = kinds + n_roles
        r = 0
        for s in range(n_sets):
            node = -1
            for j in range(packed[counts + s]):
                kind, i = packed[kinds + r], packed[ids + r]
                r += 1
                if kind == TENSOR:
                    v = here[mb, i]
                elif kind == COMPUTE:
                    v = last_compute
                elif kind == COMM:
                    v = last_comm
                else:
                    v = prefetch[i]
                if j == 0:
                    node = v
                elif v != node:
                    return starts, outside, False  # its roles name two nodes
            if node < 0:
                return starts, outside, False  # a role not played here
            resolved[s] = node
        start = cursor
        deps = ids + n_roles
        for k in range(n_out):
            x = packed[deps + k]
            node = last_compute if x < 0 else resolved[x]
            if node < 0:
                return starts, outside, False
            outside[o] = head[node]
            o += 1
        made = deps + n_out
        other = made + 2 * n_made
        tails = other + 4 * n_other
        for k in range(n_tails):
            head[start + packed[tails + k]] = start + packed[tails + n_tails + k]
        if lc >= 0:
            last_compute = start + lc
        if lm >= 0:
            last_comm = start + lm
        for k in range(n_made):
            here[mb, packed[made + k]] = start + packed[made + n_made + k]
        for k in range(n_other):
            kind, i = packed[other + k], packed[other + n_other + k]
            ref_kind, ref = packed[other + 2 * n_other + k], packed[other + 3 * n_other + k]
            node = start + ref if ref_kind == 0 else resolved[ref]
            if kind == PREFETCH:
                prefetch[i] = node
            else:
                here[mb, i] = node
        starts[e] = start
        cursor += size
    return starts, outside, True
