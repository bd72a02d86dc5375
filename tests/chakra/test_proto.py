"""stg/chakra/et_def.proto keeps Chakra's numbers, and et_def_pb2.py is generated from it."""

import ast
import shutil
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from stg.chakra import et_def_pb2 as pb

CHAKRA_DIR = Path(pb.__file__).parent


def _serialized_descriptor(pb2_source: str) -> bytes:
    """The FileDescriptorProto bytes a generated _pb2.py hands to AddSerializedFile."""
    for node in ast.walk(ast.parse(pb2_source)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "AddSerializedFile":
            return ast.literal_eval(node.args[0])
    raise AssertionError("no AddSerializedFile call in generated code")


def test_committed_pb2_matches_proto(tmp_path):
    protoc = pytest.importorskip("grpc_tools.protoc")
    # Same relative path as the documented command, so the descriptor's file name matches too.
    proto = tmp_path / "stg" / "chakra" / "et_def.proto"
    proto.parent.mkdir(parents=True)
    shutil.copy(CHAKRA_DIR / "et_def.proto", proto)
    rc = protoc.main(["protoc", f"-I{tmp_path}", f"--python_out={tmp_path}", str(proto)])
    assert rc == 0
    fresh = _serialized_descriptor((proto.parent / "et_def_pb2.py").read_text())
    committed = _serialized_descriptor((CHAKRA_DIR / "et_def_pb2.py").read_text())
    assert fresh == committed
    assert committed == pb.DESCRIPTOR.serialized_pb


def test_pb2_header_says_how_to_regenerate():
    head = (CHAKRA_DIR / "et_def_pb2.py").read_text().splitlines()[:5]
    assert any("grpc_tools.protoc -I. --python_out=. stg/chakra/et_def.proto" in line for line in head)


def test_package_and_file_name():
    fdp = descriptor_pb2.FileDescriptorProto.FromString(pb.DESCRIPTOR.serialized_pb)
    assert fdp.package == "ChakraProtoMsg"
    assert fdp.syntax == "proto3"
    assert pb.Node.DESCRIPTOR.full_name == "ChakraProtoMsg.Node"


def _numbers(message) -> dict[str, int]:
    return {f.name: f.number for f in message.DESCRIPTOR.fields}


def test_node_fields():
    assert _numbers(pb.Node) == {
        "id": 1, "name": 2, "type": 3, "ctrl_deps": 4, "data_deps": 5, "start_time_micros": 6,
        "duration_micros": 7, "inputs": 8, "outputs": 9, "attr": 10,
    }
    fields = pb.Node.DESCRIPTOR.fields_by_name
    assert fields["data_deps"].is_repeated and fields["attr"].is_repeated
    assert fields["id"].type == fields["id"].TYPE_UINT64


def test_other_messages():
    assert _numbers(pb.GlobalMetadata) == {"version": 1, "attr": 2}
    assert _numbers(pb.IOInfo) == {"values": 1, "shapes": 2, "types": 3}
    assert _numbers(pb.Tensor) == {
        "tensor_id": 1, "storage_id": 2, "offset": 3, "num_elem": 4, "elem_bytes": 5, "device": 6,
    }


def test_attribute_oneof():
    scalars = ["double", "float", "int32", "int64", "uint32", "uint64", "sint32", "sint64",
               "fixed32", "fixed64", "sfixed32", "sfixed64", "bool", "string", "bytes"]
    expected = {"name": 1, "doc_string": 2}
    for i, scalar in enumerate(scalars):
        expected[f"{scalar}_val"] = 3 + 2 * i
        expected[f"{scalar}_list"] = 4 + 2 * i
    assert _numbers(pb.AttributeProto) == expected
    oneof = pb.AttributeProto.DESCRIPTOR.oneofs_by_name["value"]
    assert len(oneof.fields) == 30
    # the numbers the consumer's types hinge on (reference A.1)
    spot = {"int32_val": 7, "int64_val": 9, "uint64_val": 13, "bool_val": 27, "string_val": 29}
    assert {k: expected[k] for k in spot} == spot
    for scalar in scalars:
        list_msg = getattr(pb, scalar.capitalize() + "List")
        assert _numbers(list_msg) == {"values": 1}


def test_enums():
    assert dict(pb.NodeType.items()) == {
        "INVALID_NODE": 0, "METADATA_NODE": 1, "MEM_LOAD_NODE": 2, "MEM_STORE_NODE": 3,
        "COMP_NODE": 4, "COMM_SEND_NODE": 5, "COMM_RECV_NODE": 6, "COMM_COLL_NODE": 7,
    }
    assert dict(pb.CollectiveCommType.items()) == {
        "ALL_REDUCE": 0, "REDUCE": 1, "ALL_GATHER": 2, "GATHER": 3, "SCATTER": 4, "BROADCAST": 5,
        "ALL_TO_ALL": 6, "REDUCE_SCATTER": 7, "REDUCE_SCATTER_BLOCK": 8, "BARRIER": 9,
    }
