"""Reading, writing and rendering .et files."""

import json

import pytest

from stg.chakra import et_def_pb2 as pb
from stg.chakra.reader import (
    Trace, TraceFormatError, attr_kind, attr_value, format_node, iter_nodes, node_attrs,
    node_to_dict, read_trace, write_trace,
)


def _attr(name, **value):
    return pb.AttributeProto(name=name, **value)


def _coll(nid):
    return pb.Node(
        id=nid, name="ar.grad", type=pb.COMM_COLL_NODE, data_deps=[3, 5],
        attr=[_attr("is_cpu_op", bool_val=False), _attr("comm_type", int64_val=pb.ALL_REDUCE),
              _attr("comm_size", int64_val=8192), _attr("pg_name", string_val="3")],
    )


def _comp(nid, name="mm", deps=()):
    return pb.Node(
        id=nid, name=name, type=pb.COMP_NODE, data_deps=list(deps), duration_micros=12,
        attr=[_attr("is_cpu_op", bool_val=False), _attr("num_ops", int64_val=1 << 40),
              _attr("tensor_size", uint64_val=4096), _attr("op_type", string_val="GEMM")],
    )


def _metadata():
    return pb.GlobalMetadata(version="0.0.4", attr=[_attr("schema", string_val="stg")])


def test_round_trip(tmp_path):
    path = tmp_path / "workload.0.et"
    nodes = [_comp(0), _coll(7), _comp(2 ** 40, deps=[0, 7])]
    write_trace(path, _metadata(), nodes)
    trace = read_trace(path)
    assert isinstance(trace, Trace)
    assert trace.metadata == _metadata()
    assert trace.nodes == tuple(nodes)
    assert list(iter_nodes(path)) == nodes


def test_empty_node_is_a_zero_length_record(tmp_path):
    path = tmp_path / "t.et"
    write_trace(path, pb.GlobalMetadata(), [pb.Node(), _comp(1)])
    assert path.read_bytes()[:2] == b"\x00\x00"  # empty metadata, empty node
    assert read_trace(path).nodes == (pb.Node(), _comp(1))


@pytest.mark.parametrize("name_len, prefix_bytes", [(10, 1), (200, 2), (20_000, 3)])
def test_multi_byte_length_varints(tmp_path, name_len, prefix_bytes):
    path = tmp_path / "t.et"
    node = _comp(1, name="n" * name_len)
    write_trace(path, pb.GlobalMetadata(), [node, _comp(2)])
    size = node.ByteSize()
    data = path.read_bytes()
    prefix = data[1:1 + prefix_bytes]  # after the 1-byte empty-metadata record
    assert prefix[-1] < 0x80 and all(b >= 0x80 for b in prefix[:-1])
    assert sum((b & 0x7F) << (7 * i) for i, b in enumerate(prefix)) == size
    assert read_trace(path).nodes == (node, _comp(2))


def test_records_across_read_chunks(tmp_path, monkeypatch):
    import stg.chakra.reader as reader

    path = tmp_path / "t.et"
    nodes = [_comp(i, name="n" * (i * 37)) for i in range(12)]
    write_trace(path, _metadata(), nodes)
    monkeypatch.setattr(reader, "_CHUNK", 3)  # every record and most varints straddle a refill
    assert read_trace(path).nodes == tuple(nodes)


def test_truncated_payload_names_the_offset(tmp_path):
    path = tmp_path / "workload.3.et"
    write_trace(path, _metadata(), [_comp(0), _coll(1)])
    data = path.read_bytes()
    last = len(data) - _coll(1).ByteSize() - 1  # offset of the last record's length prefix
    path.write_bytes(data[:-4])
    with pytest.raises(TraceFormatError) as err:
        read_trace(path)
    assert err.value.offset == last
    assert str(path) in str(err.value) and f"at byte {last}" in str(err.value)
    assert isinstance(err.value, ValueError)
    with pytest.raises(TraceFormatError):
        list(iter_nodes(path))


def test_truncated_varint(tmp_path):
    path = tmp_path / "t.et"
    write_trace(path, _metadata(), [_comp(0)])
    size = path.stat().st_size
    with open(path, "ab") as f:
        f.write(b"\x80\x80")
    with pytest.raises(TraceFormatError, match=f"at byte {size}: file ends inside a length varint"):
        read_trace(path)


def test_garbled_payload_and_empty_file(tmp_path):
    path = tmp_path / "t.et"
    path.write_bytes(b"\x00" + b"\x03\xff\xff\xff")  # empty metadata, then 3 bytes of junk
    with pytest.raises(TraceFormatError, match="at byte 1: cannot parse Node"):
        read_trace(path)
    path.write_bytes(b"")
    with pytest.raises(TraceFormatError, match="at byte 0: empty file"):
        read_trace(path)
    path.write_bytes(b"\xff" * 11)
    with pytest.raises(TraceFormatError, match="longer than 10 bytes"):
        read_trace(path)


def test_iter_nodes_streams(tmp_path):
    path = tmp_path / "t.et"
    write_trace(path, _metadata(), [_comp(0), _comp(1)])
    with open(path, "ab") as f:
        f.write(b"\x05")  # a broken tail is only hit when reached
    it = iter_nodes(path)
    assert next(it).id == 0 and next(it).id == 1
    with pytest.raises(TraceFormatError):
        next(it)


def test_attr_values_and_kinds():
    cases = [
        (_attr("a", int64_val=-3), "int64_val", -3),
        (_attr("a", uint64_val=2 ** 63), "uint64_val", 2 ** 63),
        (_attr("a", int32_val=5), "int32_val", 5),
        (_attr("a", bool_val=False), "bool_val", False),
        (_attr("a", string_val="1"), "string_val", "1"),
        (_attr("a", double_val=0.5), "double_val", 0.5),
        (_attr("a", bytes_val=b"\x01"), "bytes_val", b"\x01"),
        (_attr("a", bool_list=pb.BoolList(values=[True, False])), "bool_list", [True, False]),
        (_attr("a", int64_list=pb.Int64List(values=[1, 2])), "int64_list", [1, 2]),
        (_attr("a"), "", None),
    ]
    for attr, kind, value in cases:
        assert attr_kind(attr) == kind
        assert attr_value(attr) == value and type(attr_value(attr)) is type(value)


def test_node_attrs():
    assert node_attrs(_coll(1)) == {"is_cpu_op": False, "comm_type": 0, "comm_size": 8192, "pg_name": "3"}


def test_format_node():
    assert format_node(_coll(17)) == (
        '17 COMM_COLL_NODE "ar.grad" deps=[3, 5] comm_type=ALL_REDUCE comm_size=8192 pg_name=3'
    )
    assert format_node(_comp(4, deps=[1])) == (
        '4 COMP_NODE "mm" deps=[1] num_ops=1099511627776 tensor_size=4096 op_type=GEMM dur=12us'
    )
    send = pb.Node(id=2, type=pb.COMM_SEND_NODE, ctrl_deps=[1], attr=[
        _attr("comm_src", int32_val=0), _attr("comm_dst", int32_val=1),
        _attr("comm_tag", int32_val=5), _attr("comm_size", int64_val=64)])
    assert format_node(send) == (
        '2 COMM_SEND_NODE "" deps=[] ctrl_deps=[1] comm_src=0 comm_dst=1 comm_tag=5 comm_size=64'
    )
    assert format_node(pb.Node(id=9, type=42)) == '9 <42> "" deps=[]'


def test_node_to_dict_is_json():
    node = _coll(17)
    node.attr.append(_attr("blob", bytes_val=b"\xab"))
    d = node_to_dict(node)
    assert d == {
        "id": 17, "name": "ar.grad", "type": "COMM_COLL_NODE", "data_deps": [3, 5], "ctrl_deps": [],
        "duration_micros": 0,
        "attrs": {"is_cpu_op": False, "comm_type": "ALL_REDUCE", "comm_size": 8192, "pg_name": "3",
                  "blob": "ab"},
    }
    assert json.loads(json.dumps(d)) == d
