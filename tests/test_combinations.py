"""Every combination of the issue's plan space writes a set that `stg validate` accepts
(consistent collectives in every group, every send with its receive, no deadlock) and that
obeys the conservation laws of tests/properties.py."""

import itertools

import pytest

from properties import check_flops, check_weights, check_zero
from stg import Plan, build, generate
from stg.chakra.validate import validate

MODEL = dict(name="one-block", family="llama", layers=1, hidden=32, ffn=64, heads=4, kv_heads=4, vocab=64)
PLANS = [
    dict(dp=dp, tp=tp, sp=sp, cp=cp, zero=zero)
    for dp, tp, cp, zero in itertools.product((1, 2, 4), (1, 2, 4), (1, 2), (0, 1, 2, 3))
    for sp in ((False, True) if tp > 1 else (False,))
]


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: "-".join(f"{k}{int(v)}" for k, v in p.items()))
def test_validates(tmp_path, plan):
    out = tmp_path / "set"
    plan = Plan(**plan, global_batch=2 * plan["dp"], seq=16)
    generate(MODEL, plan, out)
    assert validate(out) == []
    workload = build(MODEL, plan)
    check_flops(MODEL, plan, workload)
    check_weights(workload)
    if plan.tp == plan.cp == 1 and plan.dp > 1:
        check_zero(build(MODEL, Plan(dp=plan.dp, zero=plan.zero, global_batch=plan.dp, seq=16)))


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recompute_validates(tmp_path, recompute):
    out = tmp_path / "set"
    plan = Plan(dp=2, tp=2, cp=2, zero=3, recompute=recompute, global_batch=4, seq=16)
    generate(MODEL, plan, out)
    assert validate(out) == []
    workload = build(MODEL, plan)
    check_flops(MODEL, plan, workload)
    check_weights(workload)
    assert workload.summary()["rank_classes"][0]["flops_recompute"] > 0
