"""A long model evaluated on its short form (stg/short.py) gives the summary of its full passes."""

import pytest

from stg import evaluate, load_model
from stg.api import build
from stg.short import short_form
from test_digests import DEEPSEEK, GPT, LLAMA

LONG = {**LLAMA, "name": "long-llama", "layers": 12}
LONG_MOE = {**DEEPSEEK, "name": "long-ds", "layers": 16, "first_dense_layers": 5}

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
    (LONG_MOE, dict(dp=2, ep=2, pp=4, expert_skew=1.0, global_batch=16)),
    (LONG_MOE, dict(ep=2, pp=4, layers_per_stage=[5, 1, 9, 1], zero=1, dp=2, global_batch=8)),
    # gradient buckets of a few blocks' gradients (the weighted blocks' cut where the real ones are),
    # with and without a pipeline, ZeRO's gathers bucketed after the step too
    (LONG, dict(dp=2, bucket_mb=0.05, global_batch=8)),
    (LONG, dict(pp=3, dp=2, zero=1, bucket_mb=0.03, global_batch=12)),
    (LONG, dict(dp=2, tp=2, zero=3, bucket_mb=0.02, grad_dtype="fp32", optimizer="adagrad", global_batch=8)),
    (LONG_MOE, dict(dp=2, ep=2, tp=2, etp=2, pp=2, bucket_mb=0.05, global_batch=8)),
    # interleaved: a stage's chunks, and the other stages' blocks between them, inside one run
    (LONG, dict(pp=2, vpp=2, schedule="interleaved", global_batch=8)),
    (LONG, dict(pp=2, vpp=3, schedule="interleaved", dp=2, zero=1, global_batch=8)),
    (LONG, dict(pp=3, vpp=2, schedule="interleaved", layers_per_stage=[1, 3, 1, 2, 1, 4], global_batch=6)),
    (LONG_MOE, dict(pp=2, vpp=2, schedule="interleaved", ep=2, dp=2, global_batch=8)),
]
LONGER = {**LLAMA, "name": "longer-llama", "layers": 24}
LONG_GPT = {**GPT, "name": "long-gpt", "layers": 12}  # tied embeddings, learned positions, dropout
PLANS += [(LONG_GPT, dict(dp=2, zero=1, global_batch=8)),  # the table read by blocks 0 and 13, counted once
          (LONG_GPT, dict(pp=2, dp=2, zero=1, global_batch=8)),  # its copy on the last stage, summed over pp
          (LONG_GPT, dict(pp=3, tp=2, layers_per_stage=[1, 10, 1], recompute="selective", global_batch=6)),
          (LONG_GPT, dict(pp=2, vpp=2, schedule="interleaved", zero=1, dp=2, global_batch=8))]
PLANS += [(LONGER, dict(pp=4, vpp=2, schedule="interleaved", tp=2, global_batch=8)),
          (LONGER, dict(pp=2, vpp=3, schedule="interleaved", recompute="full", global_batch=8))]


def test_short_form_of_published_models():
    """Hand count: Llama 3 405B's 126 blocks are the first (after the embedding), 124 alike
    (first, 122 interior, last), the last (before the head); a plan of one chunk per stage
    keeps 3 of the 124. DeepSeek-V3's 61: three dense (the third before an MoE one), the first
    MoE block, 56 alike MoE blocks, the last; interleaved plans of 2 chunks keep 5 of the 56."""
    llama = short_form(load_model("llama3-405b"))
    assert llama.model.layers == 5
    deepseek = short_form(load_model("deepseek-v3"), chunks=2)
    assert deepseek.model.layers == 4 + 5 + 1 and deepseek.model.config.first_dense_layers == 3
    # one stage: the embedding, block 1, the run's first block, one for its 122 interior
    # blocks, its last, block 126, the head
    assert llama.stage_plans(None)[0].weights == (1, 1, 1, 122, 1, 1, 1)
    # stage 2 of pp 9 (blocks 29..42, all interior): one short block standing for its 14,
    # between the run's first block (standing for blocks 2..28 of stages 0 and 1, run by
    # stage 0) and its last (for blocks 43..125, run by stage 3); block 126 and the head on
    # stage 8
    stages = build("llama3-405b", dict(pp=9, tp=8, dp=8, global_batch=64, seq=4096), nodes=False).stages
    plan = llama.stage_plans(stages)[2]
    assert [plan.virtual_stage(block) for block in range(7)] == [0, 0, 0, 2, 3, 8, 8]
    assert plan.weights == (1, 1, 1, 14, 1, 1, 1)


@pytest.mark.parametrize("spec,plan", PLANS, ids=range(len(PLANS)))
def test_short_form_gives_the_summary_of_the_full_passes(spec, plan):
    plan = {"seq": 32, **plan}
    short = build(spec, plan, nodes=False, short=True)
    assert max(op.layer for op in short.sharded.graph.ops) < spec["layers"] + 1  # it did run short
    assert short.summary() == build(spec, plan, nodes=False).summary()


def test_models_without_a_short_form_run_whole():
    """Models without a long run of alike blocks run their full passes."""
    assert short_form(load_model(LLAMA)) is None  # 4 blocks: nothing to cut
    assert short_form(load_model(LONG), chunks=5) is None  # 12 blocks: none to cut for 5 chunks a stage


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


def _position(runs, block: int, short: bool) -> tuple:
    """A block's place among alike ones: its run, and first, last or interior (or its offset
    in a run the short model keeps whole)."""
    for index, run in enumerate(runs):
        first, last = (run.start, run.start + run.kept - 1) if short else (run.first, run.last)
        if first <= block <= last:
            if run.kept == run.last - run.first + 1:
                return index, block - first
            return index, "first" if block == first else "last" if block == last else "interior"


def test_every_cut_maps_each_stage_onto_alike_blocks():
    """For 400 random cuts of a 40-block model (1 to 3 chunks per stage, stages of 1 block and
    up): each stage's blocks map onto short blocks alike to them, on its own virtual stages
    and weighed as many times as it has blocks; the blocks next to each of its chunks map onto
    blocks alike to theirs, or, for other stages' interior blocks, onto their run's first or
    last block."""
    import random

    from parallelism.pipeline import StagePlan

    rng = random.Random(0)
    spec = {**LLAMA, "name": "l40", "layers": 40, "experts": 4, "top_k": 2, "moe_ffn": 32, "first_dense_layers": 17}
    model = load_model(spec)
    for _ in range(400):
        chunks, pp = rng.randint(1, 3), rng.randint(2, 6)
        form = short_form(model, chunks)
        cuts = sorted(rng.sample(range(2, 41), pp * chunks - 1))
        stages = StagePlan(pp, chunks, (0, *cuts))
        image_of = {}
        for rank, plan in enumerate(form.stage_plans(stages)):
            mine = [stages.virtual_stage(j) % pp == rank for j in range(42)]
            image = form._image([stages.virtual_stage(j) if own else None for j, own in enumerate(mine)])
            image_of[rank] = image
            for stage in range(rank, pp * chunks, pp):
                blocks = [j for j in range(42) if stages.virtual_stage(j) == stage]
                shorts = {image[j] for j in blocks}
                assert all(_position(form.runs, j, False) == _position(form.runs, image[j], True) for j in blocks)
                assert {plan.virtual_stage(b) for b in shorts} == {stage}
                assert sum(plan.weight(b) for b in shorts) == len(blocks)
                for real, short in ((blocks[0] - 1, min(shorts) - 1), (blocks[-1] + 1, max(shorts) + 1)):
                    if 0 <= real < 42:
                        assert plan.virtual_stage(short) != stage
                        theirs, ours = _position(form.runs, real, False), _position(form.runs, short, True)
                        assert ours == theirs or (theirs[1] == "interior" and ours[1] in ("first", "last"))


def test_the_real_cut_has_as_many_edges_as_the_stages_cuts_say():
    """The tag limit reads the real cut's edge count off the stages' cuts of the short model:
    the same as the full passes' cut, for random cuts of one and two chunks per stage."""
    import random

    from stg.api import Plan, _cut, _short_edges, _short_pipelines

    rng = random.Random(1)
    for spec in (LONG, LONG_MOE):
        for _ in range(12):
            vpp, pp = rng.randint(1, 2), rng.randint(2, 4)
            split = [1] * (pp * vpp)
            for _ in range(spec["layers"] - len(split)):
                split[rng.randrange(len(split))] += 1
            plan = Plan.from_dict({"pp": pp, "vpp": vpp, "layers_per_stage": split, "global_batch": 2 * pp,
                                   "seq": 32, "ep": 2 if "experts" in spec else 1, "dp": 2,
                                   **({"schedule": "interleaved"} if vpp > 1 else {})})
            short, full = build(spec, plan, nodes=False, short=True), build(spec, plan, nodes=False)
            pipelines = _short_pipelines(plan, short.sharded.base or short.sharded, short.stages,
                                         short_form(load_model(spec), vpp))
            assert _short_edges(plan, pipelines) == len(_cut(full.sharded.base or full.sharded, full.stages))


COUNTED = [(spec, plan) for spec, plan in PLANS if plan.get("pp", 1) > 2] + [
    (LONGER, dict(pp=8, dp=2, zero=1, global_batch=32)),
    (LONGER, dict(pp=6, vpp=2, schedule="interleaved", tp=2, recompute="full", global_batch=12)),
    (LONGER, dict(pp=4, schedule="zb-h1", cp=2, bucket_mb=0.03, global_batch=8)),
    (LONG_GPT, dict(pp=4, tp=2, zero=1, dp=2, global_batch=16)),
    ({**LONG_MOE, "layers": 24}, dict(pp=6, ep=2, dp=2, expert_skew=1.0, global_batch=24)),
    # stage 3 (blocks 7..9) starts in the run of stage 2's blocks (2..7) and leaves it: its own
    ({**LONG_MOE, "first_dense_layers": 8}, dict(pp=5, ep=2, dp=2, layers_per_stage=[1, 2, 3, 3, 7],
                                                  global_batch=20)),
]


@pytest.mark.parametrize("spec,plan", COUNTED, ids=range(len(COUNTED)))
def test_a_count_takes_an_alike_middle_stage_from_an_earlier_one(spec, plan, monkeypatch):
    """Without nodes, a middle stage whose chunks hold as many blocks of one run of alike
    blocks as an earlier stage's is not lowered: it counts what that stage counts, its peers
    its own. Every rank class as lowering it gives it: stats and holes."""
    import stg.api

    plan = {"seq": 32, **plan}
    taken = build(spec, plan, nodes=False, memory_limit=2**40)
    monkeypatch.setattr(stg.api, "_alike_stages", lambda *args: {})
    lowered = build(spec, plan, nodes=False, memory_limit=2**40)
    assert [(p.key, p.stats.to_dict(), p.counted_holes) for p in taken.programs] == \
        [(p.key, p.stats.to_dict(), p.counted_holes) for p in lowered.programs]


def test_alike_middle_stages_are_found_by_their_blocks(monkeypatch):
    """Hand count: 12 blocks on 12 stages (the first also holds the embedding and block 1,
    the last block 12 and the head): blocks 2..11 are one run of alike blocks (block 1
    follows the embedding, block 12 precedes the head), so stages 2..10 count as stage 1
    does. With 24 blocks on 6 stages of 2 chunks (2 blocks a chunk, 3 on the first), stages
    1..4's chunks all lie in the run (blocks 2..23): 2..4 count as 1. A stage holding a block
    of another run (a dense block before the MoE ones) is its own. A tied model's middle
    stages hold no block of its shared table."""
    from stg.api import _alike_stages

    def alike(spec, **plan):
        workload = build(spec, {"seq": 32, **plan}, nodes=False, memory_limit=2**40)
        return _alike_stages(workload.model, workload.plan, workload.sharded, workload.stages)

    assert alike(LONG, pp=12, global_batch=24) == {stage: 1 for stage in range(2, 11)}
    assert alike(LONGER, pp=6, vpp=2, schedule="interleaved", global_batch=12) == {2: 1, 3: 1, 4: 1}
    # blocks 1..5 dense, 6..16 MoE: stages of 4 blocks, stage 1 (5..8) holds both kinds
    assert alike(LONG_MOE, pp=4, ep=2, dp=2, global_batch=16) == {}
    assert alike(LONG_MOE, pp=4, ep=2, dp=2, layers_per_stage=[2, 4, 4, 6], global_batch=16) == {}
    # blocks 6..8, 9..11, 12..14: block 6 (after a dense one) is a run of its own
    assert alike(LONG_MOE, pp=5, ep=2, dp=2, layers_per_stage=[5, 3, 3, 3, 2], global_batch=20) == {3: 2}
    assert alike(LONG_GPT, pp=4, tp=2, zero=1, dp=2, global_batch=16) == {2: 1}
    # no zoo model shares a leaf between interior blocks: one said to (blocks 5 and 9) keeps
    # their stages (4 and 8) to themselves
    import stg.api

    monkeypatch.setattr(stg.api, "shared_leaves", lambda sharded: [frozenset({5, 9})])
    assert alike(LONG, pp=12, global_batch=24) == {stage: 1 for stage in (2, 3, 5, 6, 7, 9, 10)}
