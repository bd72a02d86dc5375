"""End to end under data parallelism, checked on the decoded traces."""

import json

import pytest

from model_zoo import load_model
from stg import Plan, generate
from stg.chakra.reader import node_attrs, read_trace
from stg.chakra.validate import validate

ALL_REDUCE, COLL, COMP = 0, 7, 4


def rank_totals(out, rank):
    trace = read_trace(out / f"workload.{rank}.et")
    totals = {"allreduce_bytes": 0, "allreduce_count": 0, "flops_fb": 0, "flops_opt": 0}
    for node in trace.nodes:
        attrs = node_attrs(node)
        if node.type == COLL and attrs["comm_type"] == ALL_REDUCE:
            totals["allreduce_bytes"] += attrs["comm_size"]
            totals["allreduce_count"] += 1
        elif node.type == COMP:
            key = "flops_opt" if node.name.startswith("S ") else "flops_fb"
            totals[key] += attrs["num_ops"]
    return totals


@pytest.fixture(scope="module")
def dp4(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp4") / "set"
    generate("llama2-7b", Plan(dp=4, micro_batch=1, global_batch=8, seq=256), out)
    return out


def test_each_rank_all_reduces_the_models_gradient_bytes(dp4):
    params = load_model("llama2-7b").params
    for rank in range(4):
        assert rank_totals(dp4, rank)["allreduce_bytes"] == 2 * params  # bf16 gradients


def test_flops_summed_over_ranks_equal_one_rank_with_the_same_global_batch(dp4, tmp_path):
    one = tmp_path / "one"
    generate("llama2-7b", Plan(dp=1, micro_batch=1, global_batch=8, seq=256), one)
    summed = sum(rank_totals(dp4, r)["flops_fb"] for r in range(4))
    assert summed == rank_totals(one, 0)["flops_fb"]
    # the optimizer is not split by plain data parallelism: every rank runs the whole step
    assert rank_totals(dp4, 0)["flops_opt"] == rank_totals(one, 0)["flops_opt"]


def test_gradients_sync_once_per_step_not_per_micro_batch(tmp_path, tiny_llama):
    counts = []
    for global_batch in (2, 8):
        out = tmp_path / f"gb{global_batch}"
        summary = generate(tiny_llama, Plan(dp=2, global_batch=global_batch, seq=32), out)
        counts.append(rank_totals(out, 0)["allreduce_count"])
        assert summary["microbatches"] == global_batch // 2
    assert counts[0] == counts[1] > 0


def test_bucket_size_coalesces_gradients(tmp_path, tiny_llama):
    model = load_model(tiny_llama)
    tiny = generate(tiny_llama, Plan(dp=2, bucket_mb=1e-6, seq=32), tmp_path / "tiny")
    huge = generate(tiny_llama, Plan(dp=2, bucket_mb=1e6, seq=32), tmp_path / "huge")
    assert tiny["rank_classes"][0]["comm_count"]["ALL_REDUCE"] == len(model.graph.weights)
    assert huge["rank_classes"][0]["comm_count"]["ALL_REDUCE"] == 1
    assert tiny["rank_classes"][0]["comm_bytes"] == huge["rank_classes"][0]["comm_bytes"]


@pytest.mark.parametrize("dp", [1, 2, 3, 8])
def test_every_generated_set_validates(tmp_path, tiny_gpt, dp):
    out = tmp_path / "set"
    generate(tiny_gpt, Plan(dp=dp, global_batch=2 * dp, seq=64), out)
    assert validate(out) == []
    groups = json.loads((out / "workload.json").read_text())
    if dp == 1:
        assert groups == {}
    else:
        assert groups == {"1": list(range(dp))}


def test_summary_matches_the_traces(dp4):
    summary = json.loads((dp4 / "summary.json").read_text())
    cls = summary["rank_classes"][summary["rank_class"][2]]
    totals = rank_totals(dp4, 2)
    assert cls["comm_bytes"]["ALL_REDUCE"] == totals["allreduce_bytes"]
    assert summary["world_size"] == 4 and summary["microbatches"] == 2
    assert summary["model"]["params"] == load_model("llama2-7b").params


def test_fp32_gradients_double_the_reduction(tiny_llama):
    """--grad-dtype fp32: gradients accumulate and reduce in fp32 (4 bytes per parameter)."""
    from stg import build

    params = load_model(tiny_llama).params
    for dtype, width in (("bf16", 2), ("fp32", 4)):
        stats = build(tiny_llama, Plan(dp=2, seq=32, grad_dtype=dtype)).summary()["rank_classes"][0]
        assert stats["comm_bytes"]["ALL_REDUCE"] == width * params


def _starts(ops, values, limit):
    from types import SimpleNamespace

    from stg.lower import _BucketSteps, _ProgramBuilder

    steps = _BucketSteps(ops, [], [None] * len(values), {})
    return _ProgramBuilder._bucket_starts(SimpleNamespace(bucket_bytes=limit), steps, values)


def test_buckets_fill_to_the_limit_then_open_the_next():
    """PyTorch DDP's rule, by hand: a bucket takes gradients until its bytes reach bucket_cap,
    the next gradient opens another; one kind of collective a bucket."""
    three = [(0, 0, 0)] * 4  # four gradients of 3 bytes
    assert _starts(three, (3,), 5) == [0, 2]  # 3 + 3 reaches 5: [0, 1], [2, 3]
    assert _starts(three, (3,), 6) == [0, 2]
    assert _starts(three, (3,), 7) == [0, 3]  # 3 + 3 + 3 reaches 7
    assert _starts(three, (3,), 0) == [0, 1, 2, 3]
    assert _starts(three, (0,), 5) == [0]  # empty gradients never fill one
    assert _starts([(0, 0, 0), (1, 0, 0), (1, 0, 0), (0, 0, 0)], (3,), 100) == [0, 1, 3]  # a kind apart
    assert _starts([(0, 0, 0)] * 3, (2**62,), 2**63) == [0, 2]  # exact for any sizes
    assert _starts([(0, 0, 0)] * 3, (2**62,), 2**62) == [0, 1, 2]

