"""stg.evaluate gives, per plan, what the written set's summary.json says."""

import json

from stg import Plan, evaluate
from test_digests import PLANS, LLAMA
from stg.api import generate


def test_evaluate_equals_the_written_summary(tmp_path):
    names = ["dp", "tp-sp", "pp-interleaved", "zero3", "ep-skew", "dlrm-table_wise"]
    for name in names:
        model, plan = PLANS[name]
        row = next(evaluate(model, [{"seq": 32, **plan}]))
        generate(model, {"seq": 32, **plan}, tmp_path / name)
        written = json.loads((tmp_path / name / "summary.json").read_text())
        written.pop("rank_class")
        assert row == written, name


def test_invalid_plans_say_why():
    rows = list(evaluate(LLAMA, [Plan(tp=3, global_batch=1, seq=32), Plan(dp=2, global_batch=2, seq=32)]))
    assert "tp=3 does not divide" in rows[0]["error"] and "error" not in rows[1]
