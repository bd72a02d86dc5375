"""A rank file's node records skimmed in one compiled pass, for `stg validate` of a big set.

The stock path (stg/chakra/load.py, `_load_rank`) frames each record in Python and parses it
with protobuf's NodeSkim: about 10 us a node, most of a big set's validation. This decodes the
same fields (id, name, type, data_deps, duration_micros and where the attributes lie) of every
record with numba, leaving the attributes' checks to the same code. It is a fast path only: any
record it does not read exactly as protobuf would -- a field NodeSkim does not have, another
wire type, a name that is not ASCII (protobuf checks UTF-8), ctrl_deps (which validate reports),
a negative type, attributes not side by side, a varint over 64 bits, anything cut short --
makes it give up on the file, which the stock path then reads and reports on as always.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

import numba

# Node's fields that NodeSkim reads (stg/chakra/et_def.proto), by number; its ctrl_deps (4) are
# left to protobuf
_ID, _NAME, _TYPE, _DATA_DEPS, _DURATION, _ATTR = 1, 2, 3, 5, 7, 10
_VARINT, _LEN = 0, 2


@numba.njit(cache=True)
def _varint(buf, p, end):
    """(value, position after it), or (0, -1) when it runs past `end` or over 64 bits."""
    value = np.uint64(0)
    shift = 0
    while p < end:
        byte = buf[p]
        p += 1
        if shift == 63 and byte > 1:
            return np.uint64(0), -1
        value |= np.uint64(byte & 0x7F) << np.uint64(shift)
        if byte < 0x80:
            return value, p
        shift += 7
        if shift > 63:
            return np.uint64(0), -1
    return np.uint64(0), -1


@numba.njit(cache=True)
def _frame(buf, start):
    """The records from `start` to the end: (False where a length prefix is malformed or runs
    past the end, their payloads' starts, their ends)."""
    count, p, n = 0, start, buf.size
    while p < n:
        length, p = _varint(buf, p, n)
        if p < 0 or length > np.uint64(n - p):
            return False, np.empty(0, np.int64), np.empty(0, np.int64)
        p += np.int64(length)
        count += 1
    starts = np.empty(count, np.int64)
    ends = np.empty(count, np.int64)
    p = start
    for i in range(count):
        length, p = _varint(buf, p, n)
        starts[i] = p
        p += np.int64(length)
        ends[i] = p
    return True, starts, ends


@numba.njit(cache=True)
def _skim(buf, starts, ends, ids, types, durations, n_deps, attr_start, attr_end):
    """Each record's fields as NodeSkim parses them (a repeated scalar field: the last one) into
    the arrays given, by record; (False, ...) where a record holds anything else (see the
    module's docstring), else (True, the dependencies one record's after another's)."""
    deps = np.empty(max(16, starts.size), np.uint64)  # grown by doubling
    used = 0
    for i in range(starts.size):
        p, end = starts[i], ends[i]
        first, last = -1, -1  # the span of the attribute fields, key bytes included
        while p < end:
            here = p
            key, p = _varint(buf, p, end)
            if p < 0:
                return False, deps
            field, wire = key >> np.uint64(3), key & np.uint64(7)
            if wire == _VARINT and (field == _ID or field == _TYPE or field == _DURATION or field == _DATA_DEPS):
                value, p = _varint(buf, p, end)
                if p < 0:
                    return False, deps
                if field == _ID:
                    ids[i] = value
                elif field == _DURATION:
                    durations[i] = value
                elif field == _DATA_DEPS:  # one unpacked dependency
                    deps = _room(deps, used)
                    deps[used] = value
                    used += 1
                    n_deps[i] += 1
                elif value >> np.uint64(63):  # a negative int64: left to protobuf
                    return False, deps
                else:
                    types[i] = np.int64(value)
            elif wire == _LEN and (field == _NAME or field == _DATA_DEPS or field == _ATTR):
                length, p = _varint(buf, p, end)
                if p < 0 or length > np.uint64(end - p):
                    return False, deps
                stop = p + np.int64(length)
                if field == _NAME:
                    for q in range(p, stop):
                        if buf[q] >= 0x80:
                            return False, deps
                elif field == _DATA_DEPS:  # packed
                    while p < stop:
                        value, p = _varint(buf, p, stop)
                        if p < 0:
                            return False, deps
                        deps = _room(deps, used)
                        deps[used] = value
                        used += 1
                        n_deps[i] += 1
                elif first < 0:
                    first = here
                elif last != here:  # attributes apart: their bytes are no one span
                    return False, deps
                p = stop
                if field == _ATTR:
                    last = p
            else:
                return False, deps
        attr_start[i] = max(first, 0)
        attr_end[i] = max(last, 0)
    return True, deps[:used]


@numba.njit(cache=True)
def _room(array, used):
    """`array`, or a copy twice its size when it is full."""
    if used < array.size:
        return array
    grown = np.empty(2 * array.size, array.dtype)
    grown[:used] = array[:used]
    return grown


@numba.njit(cache=True)
def _kind_hashes(buf, types, attr_start, attr_end):
    """Per node, a 64-bit FNV-1a hash of its type and attribute bytes."""
    hashes = np.empty(types.size, np.uint64)
    for i in range(types.size):
        h = np.uint64(14695981039346656037) ^ np.uint64(types[i])
        for q in range(attr_start[i], attr_end[i]):
            h = (h ^ np.uint64(buf[q])) * np.uint64(1099511628211)
        hashes[i] = h
    return hashes


@numba.njit(cache=True)
def _alike(buf, types, attr_start, attr_end, first):
    """Whether every node's type and attribute bytes are those of node `first[i]`."""
    for i in range(types.size):
        j = first[i]
        length = attr_end[i] - attr_start[i]
        if types[i] != types[j] or length != attr_end[j] - attr_start[j]:
            return False
        for k in range(length):
            if buf[attr_start[i] + k] != buf[attr_start[j] + k]:
                return False
    return True


class Skimmed(NamedTuple):
    """A file's nodes in file order: what NodeSkim gives of each, the dependencies one node's
    after another's, and which of the file's distinct kinds each is: a kind is a type and the
    attribute records as they lie in the file (NodeSkim's `attr` field), each checked once."""

    ids: np.ndarray
    types: np.ndarray
    durations: np.ndarray
    n_deps: np.ndarray
    deps: np.ndarray
    kinds: np.ndarray  # per node, its kind's place in `spans`
    spans: list[tuple[int, bytes]]  # per kind, its type and attribute records


def skim_file(data: bytes) -> tuple[bytes, Skimmed] | None:
    """(the metadata record's payload, the nodes as NodeSkim gives them), or None where
    the stock path must read the file (an empty file, a malformed record, a field it reads
    otherwise)."""
    buf = np.frombuffer(data, dtype=np.uint8)
    framed, starts, ends = _frame(buf, 0)
    if not framed or starts.size < 2:  # no nodes: the stock path says so
        return None
    n = starts.size - 1
    ids, durations = np.zeros(n, np.uint64), np.zeros(n, np.uint64)
    types, n_deps, attr_start, attr_end = (np.zeros(n, np.int64) for _ in range(4))
    skimmed, deps = _skim(buf, starts[1:], ends[1:], ids, types, durations, n_deps, attr_start, attr_end)
    if not skimmed:
        return None
    # the nodes grouped by kind in arrays, not node by node in Python: by a hash of each one's
    # type and attribute bytes, every node then compared byte by byte with its kind's first
    _, first, kinds = np.unique(_kind_hashes(buf, types, attr_start, attr_end), return_index=True,
                                return_inverse=True)
    kinds = kinds.reshape(-1)
    if not _alike(buf, types, attr_start, attr_end, first[kinds]):  # two kinds with one hash
        return None
    spans = [(t, data[start:end]) for t, start, end in zip(types[first].tolist(), attr_start[first].tolist(),
                                                           attr_end[first].tolist())]
    return data[starts[0]:ends[0]], Skimmed(ids, types, durations, n_deps, deps, kinds, spans)


def load_compiled() -> None:
    """Load the compiled functions from numba's cache (about 0.3 s, paid at their first call in
    a process): before worker processes are forked, so that they share them."""
    skim_file(b"\x00\x00")  # an empty metadata record and an empty node
