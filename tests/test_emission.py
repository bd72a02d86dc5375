"""Emission at scale: rank ranges, worker processes and a Dask cluster all write the bytes a
plain full run writes; --count-only predicts them without writing."""

import pytest
from typer.testing import CliRunner

from stg import Plan, count, generate
from stg.cli import app

MODEL = dict(name="four-blocks", family="llama", layers=4, hidden=64, ffn=176, heads=8, kv_heads=4, vocab=1000)
PLAN = Plan(dp=2, tp=2, pp=2, global_batch=4, seq=16)


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    out = tmp_path_factory.mktemp("full") / "set"
    generate(MODEL, PLAN, out)
    return out


def files(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_rank_ranges_equal_the_full_run(full, tmp_path):
    out = tmp_path / "parts"
    for start, stop in ((0, 3), (3, 8)):
        generate(MODEL, PLAN, out, ranks=range(start, stop))
    assert files(out) == files(full)


def test_workers_give_the_same_set(full, tmp_path):
    generate(MODEL, PLAN, tmp_path / "two", workers=2)
    assert files(tmp_path / "two") == files(full)


def test_dask_local_cluster_gives_the_same_set(full, tmp_path):
    pytest.importorskip("dask.distributed")
    from model_zoo import load_model
    from stg.distributed import generate_on_dask

    generate_on_dask(load_model(MODEL), PLAN, tmp_path / "dask", tasks=3)
    assert files(tmp_path / "dask") == files(full)


def test_count_only_predicts_bytes_and_nodes(full):
    counted = count(MODEL, PLAN)
    written = sum(len(data) for name, data in files(full).items() if name.endswith(".et"))
    assert counted["bytes"] == written
    from stg.chakra.reader import iter_nodes

    assert counted["nodes"] == sum(sum(1 for _ in iter_nodes(p)) for p in full.glob("*.et"))


MOE = dict(name="tiny-moe", family="mixtral", layers=4, hidden=64, ffn=128, heads=4, kv_heads=2, vocab=512,
           experts=4, top_k=2, moe_ffn=96)


@pytest.mark.parametrize("model, plan", [
    (MODEL, Plan(dp=2, tp=2, pp=4, global_batch=8, seq=16, layers_per_stage=[1, 1, 1, 1])),
    (MOE, Plan(dp=4, ep=4, pp=2, global_batch=8, seq=16, expert_skew=1.0)),  # a class per stage and expert slot
], ids=["pp4-uneven", "moe-skew"])
def test_count_only_in_workers_predicts_every_file(model, plan, tmp_path):
    """Counted in forked workers (the rank classes lowered there, their nodes never sent
    back), each class's bytes are those of each of its ranks' files."""
    generate(model, plan, tmp_path / "set")
    sizes = sorted(p.stat().st_size for p in (tmp_path / "set").glob("*.et"))
    for workers in (1, 3):
        counted = count(model, plan, workers=workers)
        assert len(counted["classes"]) > 2
        assert sorted(c["bytes_per_rank"] for c in counted["classes"] for _ in range(c["ranks"])) == sizes


@pytest.mark.parametrize("ranks, message", [("5", "expected A:B"), ("6:3", "not a non-empty range"), ("0:99", "within 0:8")])
def test_bad_rank_range(tmp_path, ranks, message):
    import yaml

    model = tmp_path / "m.yaml"
    model.write_text(yaml.safe_dump(MODEL))
    result = CliRunner().invoke(app, ["generate", str(model), "-o", str(tmp_path / "o"), "--dp", "2", "--tp", "2",
                                      "--pp", "2", "--global-batch", "4", "--seq", "16", "--ranks", ranks])
    assert result.exit_code == 2 and message in result.output


def test_a_counted_record_has_the_length_of_the_written_one(tmp_path):
    """Counting measures each node's record field by field instead of making its bytes: over
    every strategy of the digest matrix, with ids, dependencies and durations past one varint
    byte and a name past ASCII, the measured length is that of the record written."""
    from dataclasses import replace

    from stg.api import build
    from stg.chakra.writer import _head_length, _node_parts
    from test_digests import PLANS, model_of

    for name, (_, plan) in PLANS.items():
        for program in build(model_of(name, tmp_path), {"seq": 32, **plan}).programs:
            for node in program.nodes:
                wider = replace(node, id=node.id + 20000, name=node.name + " é", duration_us=node.duration_us * 300,
                                deps=tuple(d + 200 for d in node.deps))
                assert _head_length(node)[0] == len(_node_parts(node)[0])
                assert _head_length(wider)[0] == len(_node_parts(wider)[0])
