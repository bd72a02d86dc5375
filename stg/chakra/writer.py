"""Byte-level Chakra writer: a rank class is serialized once, each rank is a patch of it.

The protobuf wire format is written by hand (field numbers from et_def.proto; see
../shared/reference/chakra-astrasim.md), because stamping a rank must be byte work: a
Skeleton holds one class's whole node stream with the rank-specific fields (communicator
group ids) left as holes of known width, and `Skeleton.stamp` copies it and writes the
rank's values into the holes with one vectorized numpy scatter per hole kind. A hole's
width is the length of its value (a group id's decimal digits), so a class has one skeleton
per combination of widths: one, since group ids of a set share their width and rank
numbers are written as fixed-width varints.
"""

from __future__ import annotations

import functools

from collections import Counter
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from stg.limits import INT32_MAX, INT64_MAX, check_schema
from stg.program import Hole, NodeType, TraceNode

SCHEMA_VERSION = "0.0.4"

_VARINT, _LEN = 0, 2
# Node fields
_ID, _NAME, _TYPE, _DATA_DEPS, _DURATION, _ATTR = 1, 2, 3, 5, 7, 10
# AttributeProto fields
_ATTR_NAME, _INT32, _INT64, _UINT64, _BOOL, _STRING = 1, 7, 9, 13, 27, 29


def _varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64  # two's complement, as protobuf encodes negative int64
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_SMALL = [_varint(v) for v in range(1 << 14)]  # node ids, deps and lengths are mostly these


def varint(value: int) -> bytes:
    if 0 <= value < 16384:
        return _SMALL[value]
    if 16384 <= value < 1 << 21:  # a class's later node ids and their dependencies
        return bytes((value & 0x7F | 0x80, value >> 7 & 0x7F | 0x80, value >> 14))
    return _varint(value)


@functools.lru_cache(maxsize=None)  # a handful of (field, wire) pairs, asked for on every node
def _key(field: int, wire: int) -> bytes:
    return varint(field << 3 | wire)


def _len_field(field: int, payload: bytes) -> bytes:
    return _key(field, _LEN) + varint(len(payload)) + payload


@functools.lru_cache(maxsize=None)
def _attr_head(name: str) -> bytes:
    return _len_field(_ATTR_NAME, name.encode())


@functools.lru_cache(maxsize=1 << 16)  # repeated layers repeat their attributes' values
def _attr(name: str, field: int, value: int | str | bool) -> bytes:
    # a oneof member is written even when it holds the default (false, 0): presence matters
    head = _attr_head(name)
    if field == _STRING:
        body = head + _len_field(_STRING, value.encode())
    else:
        body = head + _key(field, _VARINT) + varint(int(value))
    return _len_field(_ATTR, body)


_NOT_CPU = _attr("is_cpu_op", _BOOL, False)


def _record(payload: bytes) -> bytes:
    return varint(len(payload)) + payload


def metadata_record(version: str = SCHEMA_VERSION) -> bytes:
    """The GlobalMetadata message that opens every file."""
    return _record(_len_field(1, version.encode()))


def fixed_varint(value: int, width: int) -> bytes:
    """`value` as a varint of exactly `width` bytes (continuation bits on the padding, which
    every protobuf parser accepts), so that every rank's rank numbers patch the same layout."""
    assert 0 <= value < 1 << (7 * width), (value, width)
    return bytes(((value >> (7 * i)) & 0x7F) | (0x80 if i < width - 1 else 0) for i in range(width))


def rank_width(world: int) -> int:
    """Bytes of a fixed-width varint that holds every rank number of a set."""
    return max(1, ((world - 1).bit_length() + 6) // 7)


Segment = bytes | Hole  # a node's body: static bytes and holes


@functools.lru_cache(maxsize=None)  # a few attribute names and widths
def _hole_head(name: str, field: int, width: int) -> bytes:
    """An attribute record up to its value, a hole `width` bytes wide."""
    head = _len_field(_ATTR_NAME, name.encode()) + _key(field, _LEN if field == _STRING else _VARINT)
    if field == _STRING:
        head += varint(width)
    return _key(_ATTR, _LEN) + varint(len(head) + width) + head


def _check_node(node: TraceNode) -> None:
    """The backstop before any byte is written: every number fits its schema field (a varint
    of an out-of-range value decodes as garbage, or not at all)."""
    if node.type is NodeType.COMP_NODE:
        fields, values, narrowest = _COMP_FIELDS, (node.id, node.duration_us, node.flops, node.nbytes), INT64_MAX
    elif node.type is NodeType.COMM_COLL_NODE:
        fields, values, narrowest = _COLL_FIELDS, (node.id, node.duration_us, node.comm_bytes), INT64_MAX
    else:
        fields, values, narrowest = _P2P_FIELDS, (node.id, node.duration_us, node.comm_bytes, node.tag), INT32_MAX
    if 0 <= min(values) and max(values) <= narrowest:
        return  # fits every field (a compute node's FLOPs pass an int32's often)
    for field, value in zip(fields, values):
        check_schema(field, value, f"node {node.id} ({node.name})")


_COMP_FIELDS = ("id", "duration_micros", "num_ops", "tensor_size")
_COLL_FIELDS = ("id", "duration_micros", "comm_size")
_P2P_FIELDS = (*_COLL_FIELDS, "comm_tag")


@functools.lru_cache(maxsize=1 << 16)  # a repeated layer's ops repeat them
def _comp_attrs(flops: int, nbytes: int, op_type: str) -> bytes:
    # ASTRA-sim's roofline divides num_ops by tensor_size and then by the result: keep both > 0
    return (_NOT_CPU + _attr("num_ops", _INT64, max(flops, 1)) + _attr("tensor_size", _UINT64, max(nbytes, 1))
            + _attr("op_type", _STRING, op_type))


HoleAttr = tuple[str, int, Hole]  # an attribute whose value is a hole: (name, field, hole)


def _node_parts(node: TraceNode, tails: dict | None = None) -> tuple[bytes, tuple[HoleAttr, ...]]:
    """A node's record up to its holes, and the attributes holding them, which end it;
    `tails`: the part after its dependencies kept by what it is made of (_tail)."""
    name = node.name.encode()
    parts = [_ID_KEY, varint(_checked_id(node)), _NAME_KEY, varint(len(name)), name, _TYPE_FIELDS[node.type]]
    if node.deps:
        deps = b"".join(map(varint, node.deps))
        parts += (_DEPS_KEY, varint(len(deps)), deps)
    tail, holes = _tail(node, {} if tails is None else tails)
    parts.append(tail)
    return b"".join(parts), holes


_ID_KEY, _NAME_KEY, _DEPS_KEY, _DURATION_KEY = (
    _key(_ID, _VARINT), _key(_NAME, _LEN), _key(_DATA_DEPS, _LEN), _key(_DURATION, _VARINT))
_TYPE_FIELDS = {kind: _key(_TYPE, _VARINT) + varint(int(kind)) for kind in NodeType}


def _tail(node: TraceNode, tails: dict) -> tuple[bytes, tuple[HoleAttr, ...]]:
    """A node's record after its dependencies (duration and attributes before the holes) and
    its hole attributes, checked and made once per distinct value in `tails`: the copies of a
    layer's op, of a micro-batch's send, share theirs (a class of llama3-70b at tp 8, pp 4 has
    19,000 nodes and about 500 tails). Holes are keyed by identity, as a class's nodes share
    a few hole objects, whose dataclass hash is a Python call."""
    kind = node.type
    if kind is NodeType.COMP_NODE:
        key = (kind, node.duration_us, node.flops, node.nbytes, node.op_type)
    elif kind is NodeType.COMM_COLL_NODE:
        key = (kind, node.duration_us, node.comm_bytes, node.collective, id(node.group))
    else:
        key = (kind, node.duration_us, node.comm_bytes, node.tag, id(node.src), id(node.dst))
    found = tails.get(key)
    if found is None:
        _check_node(node)
        tail = _attrs(node)
        if kind is NodeType.COMP_NODE and node.duration_us:
            tail = _DURATION_KEY + varint(node.duration_us) + tail
        found = tails[key] = tail, _hole_attrs(node)
    return found


def _checked_id(node: TraceNode) -> int:
    """The node's id, which _check_node checks with the numbers of its tail."""
    if not 0 <= node.id <= INT64_MAX:
        check_schema("id", node.id, f"node {node.id} ({node.name})")
    return node.id


def _head_length(node: TraceNode, tails: dict | None = None) -> tuple[int, tuple[HoleAttr, ...]]:
    """len(_node_parts(node)[0]), field by field without making the bytes, and the node's hole
    attributes: counting a set reads only this (tests/test_emission.py holds the two equal
    on every strategy's nodes). Its numbers are never negative (_check_node; ids)."""
    name = len(node.name) if node.name.isascii() else len(node.name.encode())
    length = 3 * _KEY + _varint_length(_checked_id(node)) + _varint_length(name) + name
    length += _varint_length(int(node.type))
    if node.deps:
        deps = _varints_length(node.deps)
        length += _KEY + _varint_length(deps) + deps
    tail, holes = _tail(node, {} if tails is None else tails)
    return length + len(tail), holes


_KEY = len(_key(_DURATION, _VARINT))  # a Node field's key: one byte (field numbers below 16)


def _varint_length(value: int) -> int:
    """len(varint(value)) for value >= 0: a byte per 7 bits."""
    return (value.bit_length() + 6) // 7 or 1


def _varints_length(values: Sequence[int]) -> int:
    """The varint lengths of `values` (>= 0) summed: a node's dependencies, in one pass of C
    over a table of lengths where they are below 2**21 (a class of two million nodes)."""
    try:
        return sum(map(_SHORT_LENGTHS.__getitem__, values))
    except IndexError:
        return sum(map(_varint_length, values))


_SHORT_LENGTHS = np.repeat(np.arange(1, 4, dtype=np.uint8),
                           [1 << 7, (1 << 14) - (1 << 7), (1 << 21) - (1 << 14)]).tobytes()


def _attrs(node: TraceNode) -> bytes:
    """A node's attributes before its holes."""
    if node.type is NodeType.COMP_NODE:
        return _comp_attrs(node.flops, node.nbytes, node.op_type)
    # ASTRA-sim hangs on a 0-byte collective and aborts on a 0-byte send (measured)
    size = _attr("comm_size", _INT64, max(node.comm_bytes, 1))
    if node.type is NodeType.COMM_COLL_NODE:
        return _NOT_CPU + size + _attr("comm_type", _INT64, node.collective.value)
    return _NOT_CPU + size + _attr("comm_tag", _INT32, node.tag)


def _hole_attrs(node: TraceNode) -> tuple[HoleAttr, ...]:
    """The attributes that hold a node's holes, which end its record."""
    if node.type is NodeType.COMP_NODE:
        return ()
    if node.type is NodeType.COMM_COLL_NODE:
        return (("pg_name", _STRING, node.group),)
    return (("comm_src", _INT32, node.src), ("comm_dst", _INT32, node.dst))


def _segments(head: bytes, holes: tuple[HoleAttr, ...], width: Mapping[Hole, int]) -> list[Segment]:
    """A record's body from its head and hole attributes (_node_parts)."""
    segments: list[Segment] = [head]
    for name, field, hole in holes:
        segments += (_hole_head(name, field, width[hole]), hole)
    return segments


StreamShape = Counter  # (bytes of a record up to its holes, its hole attributes) -> how many records


def stream_shape(nodes: Sequence[TraceNode]) -> StreamShape:
    """What the length of a class's node stream depends on, whatever its holes' widths: a set
    is counted from it without a skeleton (and in a forked worker, without sending nodes back)."""
    tails: dict = {}
    return Counter(_head_length(node, tails) for node in nodes)


def stream_length(shape: StreamShape, width: Mapping[Hole, int]) -> int:
    """Bytes of the node stream of `shape` with every hole `width[hole]` bytes wide: the length
    of build_skeleton's body."""
    total = 0
    for (fixed, holes), count in shape.items():
        size = fixed + sum(len(_hole_head(name, field, width[hole])) + width[hole] for name, field, hole in holes)
        total += count * (len(varint(size)) + size)
    return total


@dataclass(frozen=True)
class Skeleton:
    body: np.ndarray  # uint8: every node record, holes zero-filled
    holes: tuple[tuple[Hole, np.ndarray], ...]  # per hole kind: [holes, width] byte positions

    def stamp(self, values: Mapping[Hole, bytes]) -> np.ndarray:
        """This rank's node stream: the skeleton with its values written into the holes."""
        out = self.body.copy()
        for hole, positions in self.holes:
            out[positions] = np.frombuffer(values[hole], dtype=np.uint8)  # broadcast over the holes
        return out


def build_skeleton(nodes: Sequence[TraceNode], width: Mapping[Hole, int]) -> Skeleton:
    """One class's node stream with every hole `width[hole]` bytes wide."""
    chunks: list[bytes] = []
    offsets: dict[Hole, list[int]] = {hole: [] for hole in width}
    position = 0  # of the next chunk; only a hole's needs it
    tails: dict = {}
    for node in nodes:
        head, holes = _node_parts(node, tails)
        if not holes:  # a compute node: its record is its head
            prefix = varint(len(head))
            chunks += (prefix, head)
            position += len(prefix) + len(head)
            continue
        segments = _segments(head, holes, width)
        prefix = varint(sum(len(s) if isinstance(s, bytes) else width[s] for s in segments))
        chunks.append(prefix)
        position += len(prefix)
        for segment in segments:
            if isinstance(segment, bytes):
                chunks.append(segment)
                position += len(segment)
            else:
                offsets[segment].append(position)
                chunks.append(bytes(width[segment]))
                position += width[segment]
    body = np.frombuffer(b"".join(chunks), dtype=np.uint8)
    holes = tuple(
        (hole, np.asarray(offs, dtype=np.int64)[:, None] + np.arange(width[hole]))
        for hole, offs in offsets.items() if offs
    )
    return Skeleton(body, holes)
