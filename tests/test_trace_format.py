"""The output decoded with the stock protobuf runtime against our .proto, attribute by
attribute, against the rules ASTRA-sim needs (../shared/reference/chakra-astrasim.md, D)."""

import json

import pytest

from stg import Plan, generate
from stg.chakra import et_def_pb2 as pb
from stg.chakra.reader import iter_nodes, read_trace
from stg.device import DEVICES

EXPECTED_KIND = {
    "is_cpu_op": "bool_val",
    "num_ops": "int64_val",
    "tensor_size": "uint64_val",
    "op_type": "string_val",
    "comm_type": "int64_val",
    "comm_size": "int64_val",
    "pg_name": "string_val",
    "comm_src": "int32_val",
    "comm_dst": "int32_val",
    "comm_tag": "int32_val",
}
REQUIRED = {
    pb.COMP_NODE: {"is_cpu_op", "num_ops", "tensor_size"},
    pb.COMM_COLL_NODE: {"is_cpu_op", "comm_type", "comm_size", "pg_name"},
}


@pytest.fixture(scope="module")
def trace_set(tmp_path_factory):
    out = tmp_path_factory.mktemp("fmt") / "set"
    generate(dict(name="t", family="gpt", layers=2, hidden=64, ffn=256, heads=4, vocab=512, max_positions=64),
             Plan(dp=4, global_batch=8, seq=32), out)
    return out


def test_every_attribute_has_the_type_astra_sim_reads(trace_set):
    groups = json.loads((trace_set / "workload.json").read_text())
    for rank in range(4):
        trace = read_trace(trace_set / f"workload.{rank}.et")
        assert trace.metadata.version == "0.0.4"
        for node in trace.nodes:
            kinds = {a.name: a.WhichOneof("value") for a in node.attr}
            for name, kind in kinds.items():
                assert kind == EXPECTED_KIND[name], (rank, node.id, name, kind)
            assert REQUIRED[node.type] <= set(kinds), (rank, node.id)
            attrs = {a.name: a for a in node.attr}
            assert attrs["is_cpu_op"].bool_val is False
            assert not node.ctrl_deps
            if node.type == pb.COMP_NODE:
                assert attrs["tensor_size"].uint64_val > 0
                assert attrs["num_ops"].int64_val > 0
            else:
                assert attrs["comm_type"].int64_val in (pb.ALL_REDUCE, pb.ALL_GATHER, pb.REDUCE_SCATTER, pb.ALL_TO_ALL)
                assert rank in groups[attrs["pg_name"].string_val]


def test_node_ids_are_program_order_and_deps_point_back(trace_set):
    nodes = list(iter_nodes(trace_set / "workload.0.et"))
    assert [n.id for n in nodes] == list(range(len(nodes)))
    for node in nodes:
        assert all(dep < node.id for dep in node.data_deps)  # hence acyclic


def test_group_file_keys_are_integers_from_one_with_no_single_rank_group(trace_set):
    groups = json.loads((trace_set / "workload.json").read_text())
    assert all(key.isdigit() and int(key) >= 1 and int(key) % 500 for key in groups)
    assert all(len(members) > 1 for members in groups.values())


def test_compute_durations_follow_the_roofline(trace_set):
    """H100 SXM: 989.4 dense bf16 TFLOP/s (a GEMM at its size's measured fraction of it), 3.35
    TB/s. Whole microseconds whose rounding error is carried along the rank's chain: every
    running total stays within half a microsecond."""
    h100 = DEVICES["h100"]
    exact = rounded = 0.0
    for node in iter_nodes(trace_set / "workload.1.et"):
        if node.type == pb.COMP_NODE:
            attrs = {a.name: a for a in node.attr}
            flops, nbytes = attrs["num_ops"].int64_val, attrs["tensor_size"].uint64_val
            gemm = attrs["op_type"].string_val.startswith("einsum")
            exact += max(flops / (989.4e12 * (h100.matmul_fraction(flops) if gemm else 1)), nbytes / 3.35e12) * 1e6
            rounded += node.duration_micros
            assert abs(rounded - exact) <= 0.5 + 1e-6
