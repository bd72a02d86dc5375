"""Every recipe in examples/ runs as documented."""

import json
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from stg.chakra.validate import validate
from stg.cli import app

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_api_example(tmp_path):
    result = subprocess.run([sys.executable, str(EXAMPLES / "api_example.py"), str(tmp_path / "out")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "8,030,261,248 parameters on 4 ranks" in result.stdout
    assert result.stdout.strip().endswith("valid")


def test_plan_example_with_the_readme_command(tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["generate", "llama3-8b", "--plan", str(EXAMPLES / "llama3-8b-dp8.yaml"),
                                      "-o", str(out), "--seq", "512", "-q"])
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 8 and summary["microbatches"] == 8
    assert validate(out) == []


def test_own_model_example(tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["generate", str(EXAMPLES / "tiny-gpt.yaml"), "--dp", "4",
                                      "--global-batch", "16", "--seq", "512", "-o", str(out), "-q"])
    assert result.exit_code == 0, result.output
    assert validate(out) == []


def test_custom_model_example(tmp_path):
    result = subprocess.run([sys.executable, str(EXAMPLES / "custom_model.py"), str(tmp_path / "out")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    # 2VH embed/head + 4 (H + 2HF) + H: counted by hand
    assert "mlp-only: 16,779,776 parameters" in result.stdout and result.stdout.strip().endswith("valid")


def test_megatron_moe_plan_example(tmp_path):
    """world = tp x pp x dp = 2 x 2 x 8 (Megatron-Core's meaning of dp); 4 micro-batches."""
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["generate", "mixtral-8x7b", "--plan", str(EXAMPLES / "mixtral-megatron.yaml"),
                                      "-o", str(out), "--seq", "256", "-q"])
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 32 and summary["microbatches"] == 4
    assert summary["layers_per_stage"] == [16, 16]  # the output layer is small beside 16 MoE blocks
    assert validate(out) == []
