"""Read and write Chakra .et files, and render their nodes for people.

On disk a .et file is ``varint(len) GlobalMetadata`` followed by any number of
``varint(len) Node`` records, with the standard base-128 little-endian varint and no
footer (reference A.4). Production traces are written by a byte-level encoder elsewhere;
``write_trace`` here builds trace sets from pb2 objects, mainly for tests.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

from google.protobuf.message import DecodeError, Message

from stg.chakra import et_def_pb2 as pb

# A uint64 needs at most 10 varint bytes; anything longer is garbage, not a length.
_MAX_VARINT_BYTES = 10
_CHUNK = 1 << 20

AttrValue = bool | int | float | str | bytes | list[Any] | None


class TraceFormatError(ValueError):
    """A .et file that is not a well-formed length-delimited GlobalMetadata + Node stream."""

    def __init__(self, path: str | os.PathLike[str], offset: int, reason: str) -> None:
        self.path = os.fspath(path)
        self.offset = offset
        self.reason = reason
        super().__init__(f"{self.path}: at byte {offset}: {reason}")


@dataclass(frozen=True)
class Trace:
    """One rank's trace: the GlobalMetadata and the nodes in file order."""

    metadata: pb.GlobalMetadata
    nodes: tuple[pb.Node, ...]


# --- on-disk format -------------------------------------------------------------------------


def _encode_varint(value: int) -> bytes:
    if value < 0:
        raise ValueError(f"varint length must be non-negative, got {value}")
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


class _Buffered:
    """A file read in large chunks, so that records can be framed without a read per byte."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.buf = b""
        self.pos = 0  # next unread byte in buf
        self.base = 0  # file offset of buf[0]

    def ensure(self, n: int) -> bool:
        """Make ``n`` bytes available at ``pos``; False if the file ends first."""
        have = len(self.buf) - self.pos
        if have >= n:
            return True
        chunks = [self.buf[self.pos:]]
        while have < n:
            more = self.f.read(max(n - have, _CHUNK))
            if not more:
                break
            chunks.append(more)
            have += len(more)
        self.base += self.pos
        self.buf, self.pos = b"".join(chunks), 0
        return have >= n


def _records(f: BinaryIO, path: str | os.PathLike[str]) -> Iterator[tuple[int, bytes]]:
    """Yield (offset of the length prefix, payload) for every record in the stream."""
    info = os.fstat(f.fileno())
    if not stat.S_ISREG(info.st_mode):
        raise TraceFormatError(path, 0, "not a regular file")
    size = info.st_size  # a length beyond the file's end is garbage: never try to read it
    s = _Buffered(f)
    while True:
        if len(s.buf) - s.pos < _MAX_VARINT_BYTES:
            s.ensure(_MAX_VARINT_BYTES)  # fewer only near the end of the file
        buf, pos = s.buf, s.pos
        if pos == len(buf):
            return
        offset = s.base + pos
        length = buf[pos]
        pos += 1
        if length >= 0x80:  # multi-byte length: rare for nodes, so off the fast path
            length, pos = _decode_long_varint(buf, s.pos, path, offset)
        s.pos = pos
        if length > size - (s.base + pos) or (pos + length > len(buf) and not s.ensure(length)):
            raise TraceFormatError(
                path, offset, f"record declares {length} bytes but the file ends after {size - (s.base + s.pos)}"
            )
        payload = s.buf[s.pos:s.pos + length]
        s.pos += length
        yield offset, payload


def _decode_long_varint(buf: bytes, pos: int, path: str | os.PathLike[str], offset: int) -> tuple[int, int]:
    """(value, position after it) of the varint at ``pos``; ``buf`` holds the rest of the file or 10+ bytes."""
    value = shift = 0
    for used in range(_MAX_VARINT_BYTES):
        if pos + used == len(buf):
            raise TraceFormatError(path, offset, f"file ends inside a length varint ({used} bytes read)")
        byte = buf[pos + used]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos + used + 1
        shift += 7
    raise TraceFormatError(path, offset, f"length varint longer than {_MAX_VARINT_BYTES} bytes")


def _parse(message: Message, payload: bytes, path: str | os.PathLike[str], offset: int) -> None:
    try:
        message.ParseFromString(payload)
    except DecodeError as err:
        kind = type(message).__name__
        raise TraceFormatError(path, offset, f"cannot parse {kind} ({len(payload)} bytes): {err}") from err


def _open_stream(
    f: BinaryIO, path: str | os.PathLike[str]
) -> tuple[pb.GlobalMetadata, Iterator[tuple[int, bytes]]]:
    records = _records(f, path)
    first = next(records, None)
    if first is None:
        raise TraceFormatError(path, 0, "empty file: no GlobalMetadata record")
    metadata = pb.GlobalMetadata()
    _parse(metadata, first[1], path, first[0])
    return metadata, records


def read_metadata(path: str | os.PathLike[str]) -> pb.GlobalMetadata:
    """The GlobalMetadata record that opens a .et file (nothing after it is read)."""
    with open(path, "rb") as f:
        metadata, _ = _open_stream(f, path)
    return metadata


def iter_node_records(path: str | os.PathLike[str]) -> Iterator[tuple[int, bytes]]:
    """Yield (byte offset, serialized Node) per node record, after checking the GlobalMetadata.

    For callers that parse nodes with their own message class (the validator skims them).
    """
    with open(path, "rb") as f:
        _, records = _open_stream(f, path)
        yield from records


def iter_nodes(path: str | os.PathLike[str]) -> Iterator[pb.Node]:
    """Yield the nodes of a .et file one at a time (the GlobalMetadata is parsed and dropped)."""
    for offset, payload in iter_node_records(path):
        node = pb.Node()
        _parse(node, payload, path, offset)
        yield node


def read_trace(path: str | os.PathLike[str]) -> Trace:
    """Read a whole .et file into memory."""
    with open(path, "rb") as f:
        metadata, records = _open_stream(f, path)
        nodes = []
        for offset, payload in records:
            node = pb.Node()
            _parse(node, payload, path, offset)
            nodes.append(node)
    return Trace(metadata=metadata, nodes=tuple(nodes))


def write_trace(
    path: str | os.PathLike[str], metadata: pb.GlobalMetadata, nodes: Iterable[pb.Node]
) -> None:
    """Write ``metadata`` then ``nodes``, each length-prefixed, in the order given."""
    with open(path, "wb") as f:
        for message in (metadata, *nodes):
            payload = message.SerializeToString()
            f.write(_encode_varint(len(payload)))
            f.write(payload)


# --- attributes -----------------------------------------------------------------------------


def attr_kind(attr: pb.AttributeProto) -> str:
    """Name of the oneof member that is set (e.g. "int64_val"), or "" when none is."""
    return attr.WhichOneof("value") or ""


def attr_value(attr: pb.AttributeProto) -> AttrValue:
    """Python value of the set oneof member; lists for the XxxList members, None when unset."""
    kind = attr.WhichOneof("value")
    if kind is None:
        return None
    value = getattr(attr, kind)
    if kind.endswith("_list"):
        return list(value.values)
    return value


def node_attrs(node: pb.Node) -> dict[str, AttrValue]:
    """Attributes by name. ASTRA-sim looks names up one at a time; a repeated name keeps the last."""
    return {attr.name: attr_value(attr) for attr in node.attr}


# --- rendering ------------------------------------------------------------------------------


def _enum_name(enum: Any, value: int) -> str:
    try:
        return enum.Name(value)
    except ValueError:  # proto3 enums are open: unknown numbers survive parsing
        return f"<{value}>"


def _render(name: str, value: AttrValue) -> str:
    if name == "comm_type" and isinstance(value, int) and not isinstance(value, bool):
        return _enum_name(pb.CollectiveCommType, value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if value and " " not in value else json.dumps(value)
    return str(value)


# Attributes worth a place on the one-line summary, by node type, in display order.
_KEY_ATTRS: dict[int, tuple[str, ...]] = {
    pb.COMP_NODE: ("num_ops", "tensor_size", "op_type"),
    pb.COMM_COLL_NODE: ("comm_type", "comm_size", "pg_name"),
    pb.COMM_SEND_NODE: ("comm_src", "comm_dst", "comm_tag", "comm_size"),
    pb.COMM_RECV_NODE: ("comm_src", "comm_dst", "comm_tag", "comm_size"),
}


def format_node(node: pb.Node) -> str:
    """One line: ``17 COMM_COLL_NODE "ar.grad" deps=[3, 5] comm_type=ALL_REDUCE ...``."""
    parts = [str(node.id), _enum_name(pb.NodeType, node.type), json.dumps(node.name)]
    parts.append(f"deps={list(node.data_deps)}")
    if node.ctrl_deps:
        parts.append(f"ctrl_deps={list(node.ctrl_deps)}")
    attrs = node_attrs(node)
    for name in _KEY_ATTRS.get(node.type, ()):
        if name in attrs:
            parts.append(f"{name}={_render(name, attrs[name])}")
    if node.type == pb.COMP_NODE or node.duration_micros:
        parts.append(f"dur={node.duration_micros}us")
    return " ".join(parts)


def _jsonable(value: AttrValue) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value


def node_to_dict(node: pb.Node) -> dict[str, Any]:
    """JSON-able view of a node; enum numbers (type, comm_type) become their names."""
    attrs: dict[str, Any] = {}
    for name, value in node_attrs(node).items():
        if name == "comm_type" and isinstance(value, int) and not isinstance(value, bool):
            attrs[name] = _enum_name(pb.CollectiveCommType, value)
        else:
            attrs[name] = _jsonable(value)
    return {
        "id": node.id,
        "name": node.name,
        "type": _enum_name(pb.NodeType, node.type),
        "data_deps": list(node.data_deps),
        "ctrl_deps": list(node.ctrl_deps),
        "duration_micros": node.duration_micros,
        "attrs": attrs,
    }
