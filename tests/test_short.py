"""A long model evaluated on its short form (stg/short.py) gives the summary of its full passes."""

import pytest

from stg import evaluate, load_model
from stg.api import build
from stg.short import short_form
from test_digests import DEEPSEEK, GPT, LLAMA

LONG = {**LLAMA, "name": "long-llama", "layers": 12}
LONG_MOE = {**DEEPSEEK, "name": "long-ds", "layers": 12, "first_dense_layers": 5}

PLANS = [
    (LONG, dict(dp=2, global_batch=8)),
    (LONG, dict(tp=2, global_batch=4)),
    (LONG, dict(tp=2, sp=False, dp=2, global_batch=8)),
    (LONG, dict(cp=2, dp=2, zero=1, global_batch=4)),
    (LONG, dict(dp=2, zero=2, recompute="full", global_batch=8)),
    (LONG, dict(dp=2, tp=2, zero=3, recompute="selective", global_batch=8)),
    (LONG, dict(tp=2, fp8=True, global_batch=4)),
    (LONG, dict(dp=2, dtype="fp32", global_batch=8)),
    (LONG, dict(pp=2, tp=2, global_batch=8)),
    (LONG, dict(pp=3, schedule="gpipe", dp=2, zero=1, global_batch=12)),
    (LONG, dict(pp=4, schedule="zb-h1", dp=2, global_batch=16)),
    (LONG, dict(pp=6, dp=2, zero=3, recompute="full", global_batch=16)),
    (LONG, dict(pp=12, global_batch=24)),  # every boundary inside the run of alike blocks
    # a stage of one block at either end, a stage ending on the run's first block and one
    # starting on its last
    (LONG, dict(pp=4, layers_per_stage=[1, 1, 9, 1], global_batch=8)),
    (LONG, dict(pp=4, layers_per_stage=[2, 8, 1, 1], tp=2, global_batch=8)),
    (LONG, dict(pp=3, layers_per_stage="auto", global_batch=6)),
    (LONG_MOE, dict(dp=4, ep=2, tp=2, global_batch=8)),
    (LONG_MOE, dict(dp=2, ep=2, pp=3, expert_skew=1.0, global_batch=12)),
    (LONG_MOE, dict(ep=2, pp=4, layers_per_stage=[5, 1, 5, 1], zero=1, dp=2, global_batch=8)),
]


def test_short_form_of_published_models():
    """Hand count: Llama 3 405B's 126 blocks are the first (after the embedding), 124 alike,
    the last (before the head); the alike run keeps its first, its last and one block for its
    122 middle ones. DeepSeek-V3's 61: three dense (the third before an MoE one), the first MoE
    block, 56 alike MoE blocks (one standing for 54), the last."""
    llama = short_form(load_model("llama3-405b"))
    assert llama.model.layers == 5
    assert llama.image == (0, 1, 2) + (3,) * 122 + (4, 5, 6)
    deepseek = short_form(load_model("deepseek-v3"))
    assert deepseek.model.layers == 8 and deepseek.model.config.first_dense_layers == 3
    assert deepseek.image == (0, 1, 2, 3, 4, 5) + (6,) * 54 + (7, 8, 9)
    # stage 2 of pp 9 (blocks 29..42) is 14 of the middle block, between a middle block on
    # stage 1 and one on stage 3
    stages = build("llama3-405b", dict(pp=9, tp=8, dp=8, global_batch=64, seq=4096), nodes=False).stages
    plan = llama.stage_plans(stages)[2]
    assert [plan.virtual_stage(block) for block in range(7)] == [1, 1, 1, 2, 3, 3, 3]
    assert plan.weights == (1, 1, 1, 14, 1, 1, 1)


@pytest.mark.parametrize("spec,plan", PLANS, ids=range(len(PLANS)))
def test_short_form_gives_the_summary_of_the_full_passes(spec, plan):
    plan = {"seq": 32, **plan}
    short = build(spec, plan, nodes=False, short=True)
    assert max(op.layer for op in short.sharded.graph.ops) < spec["layers"] + 1  # it did run short
    assert short.summary() == build(spec, plan, nodes=False).summary()


def test_models_without_a_short_form_run_whole():
    """Tied weights (read on the first and last stage), interleaved stages (a rank's chunks
    would need ranges of their own) and models without a long run of alike blocks run their
    full passes; evaluate's rows are the same either way."""
    assert short_form(load_model({**GPT, "layers": 12})) is None
    assert short_form(load_model(LLAMA)) is None  # 4 blocks: nothing to cut
    interleaved = dict(pp=2, vpp=2, schedule="interleaved", global_batch=8, seq=32)
    workload = build(LONG, interleaved, nodes=False, short=True)
    assert max(op.layer for op in workload.sharded.graph.ops) == LONG["layers"] + 1
    assert next(evaluate(LONG, [interleaved])) == build(LONG, interleaved, nodes=False).summary(per_rank=False)


@pytest.mark.parametrize("plan", [
    # more trace nodes per rank than MAX_NODES counted on the real blocks (not on the short ones)
    dict(global_batch=8192),
    dict(tp=3, global_batch=4),  # tp=3 does not divide heads=4: the same tensor named
    dict(pp=5, global_batch=10),  # pp=5 does not divide 12 blocks
])
def test_refusals_are_those_of_the_full_passes(plan):
    plan = {"seq": 32, **plan}
    row = next(evaluate(LONG, [plan]))
    with pytest.raises(Exception) as full:
        build(LONG, plan, nodes=False)
    assert row["error"] == str(full.value)
