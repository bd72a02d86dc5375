"""Models described op by op in YAML (family `graph`): any architecture, no stg code."""

import copy
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from model_zoo import load_model
from stg import Plan, build, generate
from stg.chakra.validate import validate
from stg.cli import app

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
LLAMA_OPS = EXAMPLES / "llama3-8b-ops.yaml"


def test_hand_written_llama_has_the_zoo_count():
    assert load_model(str(LLAMA_OPS)).params == 8_030_261_248


def test_hand_written_llama_equals_the_zoo_model_per_rank():
    """Under dp=2, tp=2, pp=2: per-rank FLOPs, collective bytes and send/recv bytes."""
    plan = Plan(dp=2, tp=2, pp=2, global_batch=4, seq=256)
    ops, zoo = build(str(LLAMA_OPS), plan).summary(), build("llama3-8b", plan).summary()
    keys = ("flops", "flops_by_phase", "comm_bytes", "comm_count", "send_bytes", "recv_bytes", "memory")
    for mine, theirs in zip(ops["rank_classes"], zoo["rank_classes"], strict=True):
        assert {k: mine[k] for k in keys} == {k: theirs[k] for k in keys}


def test_made_up_architecture_validates_under_every_strategy(tmp_path):
    out = tmp_path / "set"
    generate(str(EXAMPLES / "parallel-block.yaml"), Plan(dp=4, tp=2, pp=2, ep=2, global_batch=8, seq=32), out,
             workers=2)
    assert validate(out) == []


SPEC = yaml.safe_load((EXAMPLES / "parallel-block.yaml").read_text())


def broken(change):
    spec = copy.deepcopy(SPEC)
    change(spec)
    return spec


def set_op(index, line):
    return lambda spec: spec["blocks"][1]["ops"].__setitem__(index, line)


@pytest.mark.parametrize("spec, message", [
    (broken(lambda s: s["blocks"][1]["params"].__setitem__("wq", ["H", "X", "Dh"])),
     "parameter layers.0.wq: shape entry 'X': unknown name 'X'"),
    (broken(set_op(1, "q = einsum(bsd,had->bsad, h, wq)")),
     "op layers.0.q = einsum(...): op layers.0.q: einsum index 'd' is H in one operand but Dh in layers.0.wq"),
    (broken(set_op(0, "h = rmsnorm(later, norm)")),
     "op layers.0.h = rmsnorm(...): unknown tensor 'later'"),
    (broken(lambda s: s["blocks"][1]["params"].__setitem__("unused", ["H"])),
     "weight layers.0.unused [H] bf16 is never used"),
    (broken(lambda s: s["dims"].__setitem__("H", 256)), "dimension H: expected [logical axis, size]"),
    (broken(set_op(1, "q = matmul(h, wq)")), "op layers.0.q = matmul(...): unknown op 'matmul'"),
])
def test_malformed_descriptions_name_the_op(tmp_path, spec, message):
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump(spec))
    result = CliRunner().invoke(app, ["generate", str(path), "-o", str(tmp_path / "out"), "--seq", "16"])
    assert result.exit_code == 2, result.output
    assert message in result.output.replace("\n", "")


def test_describe_a_described_model():
    text = CliRunner().invoke(app, ["describe", str(LLAMA_OPS)]).output
    assert "%layers.0.q: [B, S, Akv, G, Dh] bf16 = einsum[bsh,hngd->bsngd](%layers.0.h, %layers.0.wq)" in text
    assert "8,030,261,248 parameters" in text
