"""Every model family x every schedule x pp x micro-batches x tp x ZeRO, each set replayed whole.

The matrix that would have caught tied embeddings deadlocking under pipeline parallelism
(issue 18): the tied gradient's all-reduce over {first, last} stage went out on the last
stage's one comm chain ahead of the input gradient its peer stage was waiting for. Each
plan's rank programs are replayed together, every rank of the set (the replay `stg validate`
runs on the written files), in memory; a few are also written and validated from disk.
"""

from __future__ import annotations

import itertools
import json

import pytest
import yaml

from properties import check_flops, check_pipeline_sends
from stg.api import build, generate
from stg.chakra.validate import validate
from stg.errors import PlanError
from stg.plan import Plan
from stg.slice_check import replay_ranks

from pathlib import Path

EXAMPLES = Path(__file__).parent.parent / "examples"

GRAPH = yaml.safe_load((EXAMPLES / "parallel-block.yaml").read_text())
GRAPH["dims"] = {"H": ["embed", 64], "F": ["mlp", 128], "V": ["vocab", 512], "A": ["heads", 4], "Dh": ["head_dim", 16]}
GRAPH["blocks"][1]["repeat"] = 8

HF_TIED = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "tie_word_embeddings": True}

# eight blocks, so that pp 4 x vpp 2 places one block per virtual stage
FAMILIES = {
    "gpt": dict(name="m-gpt", family="gpt", layers=8, hidden=64, ffn=128, heads=4, vocab=512, max_positions=64),
    "llama": dict(name="m-llama", family="llama", layers=8, hidden=64, ffn=128, heads=4, kv_heads=2, vocab=512),
    "mixtral": dict(name="m-mixtral", family="mixtral", layers=8, hidden=64, ffn=128, heads=4, kv_heads=2,
                    vocab=512, experts=4, top_k=2, moe_ffn=32),
    "deepseek": dict(name="m-ds", family="deepseek", layers=8, hidden=64, ffn=128, heads=4, vocab=512, experts=4,
                     moe_ffn=32, top_k=2, shared_experts=1, first_dense_layers=1, q_lora_rank=32, kv_lora_rank=16,
                     qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8),
    "graph": GRAPH,
    "hf": "hf",
}
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)]


def _model(family, tmp_path_factory):
    if family != "hf":
        return FAMILIES[family]
    path = tmp_path_factory.mktemp("hf") / "config.json"
    path.write_text(json.dumps(HF_TIED))
    return str(path)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("pp", [2, 4])
def test_every_schedule_replays_to_the_end(family, pp, tmp_path_factory):
    model = _model(family, tmp_path_factory)
    checked, counts = 0, sorted({1, 2, pp, 2 * pp})
    for (schedule, vpp), per_rank, tp, zero in itertools.product(SCHEDULES, counts, (1, 2), (0, 1, 2, 3)):
        plan = Plan(pp=pp, vpp=vpp, schedule=schedule, tp=tp, zero=zero, micro_batch=1, global_batch=per_rank,
                    seq=32)
        try:
            workload = build(model, plan)
        except PlanError as error:  # Megatron's interleaving needs whole groups of pp micro-batches
            assert schedule == "interleaved" and "micro" in str(error), error
            continue
        problems = replay_ranks(workload, list(range(workload.mesh.size)))
        assert not problems, f"{plan}: {problems[:3]}"
        check_flops(model, plan, workload)
        check_pipeline_sends(workload)
        checked += 1
    # every plan but interleaved ones whose micro-batches are not a multiple of pp
    assert checked == 2 * 4 * (3 * len(counts) + sum(m % pp == 0 for m in counts))


@pytest.mark.parametrize("args", [
    dict(pp=2, global_batch=4),
    dict(pp=2, dp=2, zero=2, global_batch=2),
    dict(pp=2, vpp=2, schedule="interleaved", global_batch=4),
    dict(pp=4, schedule="gpipe", tp=2, zero=3, global_batch=8),
])
def test_tied_gpt_sets_validate_from_disk(args, tmp_path):
    out = tmp_path / "out"
    generate(FAMILIES["gpt"], Plan(seq=32, **args), out)
    assert validate(out) == []


def test_a_broken_schedule_is_refused_before_writing(tmp_path, monkeypatch):
    """Stage 0 runs micro-batch 0's backward before its forward: it waits for a gradient that
    stage 1 can only make from the activation stage 0 has not sent yet."""
    from typer.testing import CliRunner

    import stg.api
    from stg.cli import app
    from stg.schedule import Order

    class Broken(Order):
        @property
        def stages(self):
            schedule = [list(actions) for actions in super().stages]
            first_b = next(n for n, a in enumerate(schedule[0]) if a.kind.value == "B")
            schedule[0][0], schedule[0][first_b] = schedule[0][first_b], schedule[0][0]
            return schedule

    real = stg.api.order
    monkeypatch.setattr(stg.api, "order", lambda *args: Broken(*vars(real(*args)).values()))
    model = tmp_path / "model.yaml"
    model.write_text(yaml.safe_dump(FAMILIES["llama"]))
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["generate", str(model), "--pp", "2", "--global-batch", "2", "--seq", "32",
                                      "-o", str(out)])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "slice check failed, nothing written: replay deadlocks" in lines[0], result.output
    assert "stage 0 (rank 0)" in lines[0] and "RECV" in lines[0]
    assert not out.exists() and list(tmp_path.iterdir()) == [model]


def test_a_receive_nobody_waits_for_is_named(tmp_path, monkeypatch):
    """Issue 19: a lowering that emits receives without making their readers depend on them
    (compute no longer waits for the data) must fail `stg validate` and the pre-write check."""
    from stg.emit import write_trace_set
    from stg.lower import _ProgramBuilder
    from stg.slice_check import SliceCheckError

    real = _ProgramBuilder.recv

    def recv(self, edge, microbatch, where):
        saved = dict(where)
        real(self, edge, microbatch, where)
        where.clear()
        where.update(saved)

    monkeypatch.setattr(_ProgramBuilder, "recv", recv)
    plan = Plan(pp=2, global_batch=2, seq=32)
    workload = build(FAMILIES["llama"], plan)
    out = tmp_path / "out"
    write_trace_set(out, workload, workload.summary())  # bypasses generate's check
    problems = [str(p) for p in validate(out)]
    assert any(p.startswith("rank 0, node ") and "RECV from rank 1" in p
               and p.endswith("no node depends on it, so nothing waits for the data it brings") for p in problems)
    with pytest.raises(SliceCheckError, match="RECV from stage 1 .rank 1.* nothing waits"):
        generate(FAMILIES["llama"], plan, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
