"""Seeded random plans over every model family and strategy, each checked against conservation
laws (tests/properties.py) and replayed whole, every rank (what `stg validate` replays)."""

from __future__ import annotations

import random

import pytest

from properties import check_flops, check_pipeline_sends, check_weights, check_zero
from stg.api import build
from stg.errors import PlanError
from stg.plan import Plan
from stg.slice_check import replay_ranks
from test_pipeline_matrix import FAMILIES

MOE = {"mixtral", "deepseek"}
SEEDS = range(60)


def random_plan(rng: random.Random, family: str) -> Plan:
    moe = family in MOE
    tp = rng.choice((1, 2))
    pp = rng.choice((1, 2, 4))
    schedule = rng.choice(("gpipe", "1f1b", "interleaved", "zb-h1")) if pp > 1 else "1f1b"
    vpp = 2 if schedule == "interleaved" else 1
    cp, ep = rng.choice((1, 2)) if not moe else 1, rng.choice((1, 2)) if moe else 1
    dp = rng.choice((1, 2)) * ep  # ep is carved out of dp (Megatron-Core)
    per_rank = rng.choice((1, 2, 4)) * (pp if schedule == "interleaved" else 1)
    micro = rng.choice((1, 2))
    return Plan(dp=dp, tp=tp, sp=tp > 1 and (moe or rng.random() < 0.7), cp=cp, pp=pp, vpp=vpp, schedule=schedule,
                ep=ep, zero=rng.choice((0, 1, 2, 3)), recompute=rng.choice(("none", "none", "selective", "full")),
                etp=tp if moe and rng.random() < 0.5 else 1,
                micro_batch=micro, global_batch=micro * dp * per_rank, seq=32,
                expert_skew=rng.choice((0, 0, 1.0)) if ep > 1 else 0)


@pytest.mark.parametrize("seed", SEEDS)
def test_random_plan_obeys_the_laws(seed):
    rng = random.Random(seed)
    family = rng.choice(sorted(set(FAMILIES) - {"hf"}))
    model, plan = FAMILIES[family], random_plan(rng, family)
    try:
        workload = build(model, plan)
    except PlanError as error:  # e.g. tp=2 over 2 kv heads is fine; report anything else
        pytest.fail(f"{plan}: {error}")
    assert replay_ranks(workload, list(range(workload.mesh.size))) == [], plan
    check_flops(model, plan, workload, rel=1e-5 if plan.expert_skew else 0.0)  # skew: loads rounded per op
    check_weights(workload)
    if plan.pp > 1:
        check_pipeline_sends(workload)
    if plan.tp == plan.cp == plan.pp == plan.ep == 1 and plan.dp > 1 and plan.microbatches == 1:
        check_zero(workload)
