"""Exit 0 means a valid set: every number that reaches a trace is whole, positive, finite and
fits its schema field, and the CLI, plan files and the Python API refuse the same values with
the same one-line message."""

import json
import re

import pytest
from typer.testing import CliRunner

import yaml

from model_zoo import load_model
from stg import Plan
from stg.api import count, generate
from stg.chakra.validate import validate
from stg.cli import app
from stg.errors import StgError
from stg.limits import check_int, check_number

BIG = 2**63
TINY = {"name": "tiny", "family": "llama", "layers": 2, "hidden": 64, "ffn": 128, "heads": 4, "vocab": 256}


def cli(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    return result.exit_code, result.output


def one_line(output):
    lines = output.strip().splitlines()
    return len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in output


# (plan field, value, CLI option, text of the refusal)
REFUSED = [
    ("seq", BIG, "--seq", "seq: 9223372036854775808 is too large"),
    ("micro_batch", BIG, "--micro-batch", "micro_batch: 9223372036854775808 is too large"),
    ("make_vocab_divisible_by", BIG, "--make-vocab-divisible-by", "make_vocab_divisible_by: 9223372036854775808 is too large"),
    ("capacity_factor", float(BIG), "--capacity-factor", "capacity_factor: 9.223372036854776e+18 is too large"),
    ("global_batch", BIG, "--global-batch", "global_batch: 9223372036854775808 is too large"),
    ("dp", BIG, "--dp", "dp: 9223372036854775808 is too large"),
    ("local_world_size", BIG, "--local-world-size", "local_world_size: 9223372036854775808 is too large"),
    ("bucket_mb", float("nan"), "--bucket-mb", "bucket_mb: must be a finite number, got nan"),
    ("bucket_mb", float("inf"), "--bucket-mb", "bucket_mb: must be a finite number, got inf"),
    ("bucket_mb", 1e308, "--bucket-mb", "bucket_mb: 1e+308 is too large"),
    ("capacity_factor", float("nan"), "--capacity-factor", "capacity_factor: must be a finite number"),
    ("expert_skew", float("nan"), "--expert-skew", "expert_skew: must be a finite number"),
    ("expert_skew", 1e6, "--expert-skew", "expert_skew: 1000000.0 is too large"),
    ("embedding_memory_gib", float("inf"), "--embedding-memory-gib", "embedding_memory_gib: must be a finite number"),
    ("embedding_memory_gib", 1e308, "--embedding-memory-gib", "embedding_memory_gib: 1e+308 is too large"),
]


@pytest.mark.parametrize("field, value, option, message", REFUSED)
def test_cli_plan_file_and_api_refuse_alike(tmp_path, field, value, option, message):
    with pytest.raises(StgError) as raised:
        Plan(**{field: value})
    assert message in str(raised.value)
    code, output = cli("generate", "llama3-8b", option, repr(value) if isinstance(value, float) else value,
                       "-o", tmp_path / "out")
    assert code == 2 and one_line(output) and message in output, output
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({field: value}))  # nan and inf as .nan and .inf
    code, output = cli("generate", "llama3-8b", "--plan", plan, "-o", tmp_path / "out")
    assert code == 2 and one_line(output) and message in output, output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("model, plan, field", [
    (TINY, dict(seq=2**40), "num_ops"),
    ({**TINY, "hidden": 2**40, "heads": 1}, dict(seq=16), "num_ops"),
    ({**TINY, "vocab": 2**62}, dict(seq=16), "num_ops"),
])
def test_values_that_overflow_a_schema_field_are_refused_before_writing(tmp_path, model, plan, field):
    with pytest.raises(StgError, match=f"{field}=[0-9]+ does not fit the trace schema's u?int64 field"):
        generate(model, Plan(**plan), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(StgError, match=field):
        count(model, Plan(**plan))


@pytest.mark.parametrize("change, message", [
    ({"hidden": BIG}, "hidden: 9223372036854775808 is too large"),
    ({"layers": BIG}, "layers: 9223372036854775808 is too large"),
    ({"hidden": 1e30}, "hidden: must be a positive integer, got 1e+30"),
])
def test_model_sizes_are_bounded(tmp_path, change, message):
    with pytest.raises(StgError, match=re.escape(message)):
        load_model({**TINY, **change})
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump({**TINY, **change}))
    code, output = cli("generate", path, "-o", tmp_path / "out")
    assert code == 2 and one_line(output) and message in output, output


def test_hf_config_numbers_are_checked(tmp_path):
    base = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
            "num_attention_heads": 4, "vocab_size": 256}
    for value, text in ((1e30, "1e30"), (10**30, str(10**30)), (None, "NaN")):
        raw = json.dumps(base).replace('"hidden_size": 64', f'"hidden_size": {text}')
        (tmp_path / "config.json").write_text(raw)
        code, output = cli("generate", tmp_path / "config.json", "-o", tmp_path / "out")
        assert code == 2 and one_line(output) and ("hidden" in output or "NaN" in output), output
        assert not (tmp_path / "out").exists()


def test_work_beyond_memory_is_refused_at_once():
    with pytest.raises(StgError, match="world size .* is too large"):
        Plan(dp=2**12, tp=2**11)
    with pytest.raises(StgError, match="micro-batches per rank is too many"):
        Plan(global_batch=2**62)
    with pytest.raises(StgError, match="trace nodes per rank"):
        count("llama3-8b", Plan(global_batch=2**14, seq=16))
    code, output = cli("schedule", "--pp", "4", "--microbatches", BIG)
    assert code == 2 and one_line(output) and "microbatches: 9223372036854775808 is too large" in output
    code, output = cli("schedule", "--pp", 2**19, "--microbatches", 2**10)
    assert code == 2 and one_line(output) and "pipeline slots is too many" in output


def test_an_exit_0_set_at_the_largest_allowed_values_validates(tmp_path):
    """Sizes at the edge of what the schema holds still give a set that validates."""
    generate(TINY, Plan(seq=2**20, micro_batch=2**8), tmp_path / "out")
    assert validate(tmp_path / "out") == []


@pytest.mark.parametrize("value", [True, "3", 3.0, None, 0, -1])
def test_check_int_wants_a_positive_integer(value):
    with pytest.raises(StgError, match="x: must be a positive integer"):
        check_int("x", value)


@pytest.mark.parametrize("value", [float("nan"), float("-inf"), "1", True, -1.0, 0.0])
def test_check_number_wants_a_finite_positive_number(value):
    with pytest.raises(StgError, match="x: must be"):
        check_number("x", value)
