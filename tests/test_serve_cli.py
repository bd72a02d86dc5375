"""`stg serve` as the README's Serving section runs it (smaller sizes), and its bad input."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stg.chakra.validate import validate
from stg.cli import app

EXAMPLES = str(Path(__file__).resolve().parent.parent / "examples")


@pytest.mark.parametrize("args", [
    ["llama3-8b", "--mode", "prefill", "--batch", "2", "--prompt", "256", "--tp", "2"],
    ["llama3-8b", "--mode", "decode", "--batch", "4", "--context", "256", "--steps", "3", "--tp", "2", "--pp", "2"],
    [EXAMPLES + "/tiny-gpt.yaml", "--requests", EXAMPLES + "/requests-azure.csv", "--tp", "2", "--dp", "2"],
    ["llama3-8b", "--requests", EXAMPLES + "/requests-mooncake.jsonl", "--scheduler", "vllm",
     "--max-num-batched-tokens", "1024"],
    [EXAMPLES + "/tiny-gpt.yaml", "--requests", EXAMPLES + "/requests-azure.csv", "--prefill-instances", "1",
     "--decode-instances", "2", "--tp", "2"],
    [EXAMPLES + "/tiny-gpt.yaml", "--requests", EXAMPLES + "/requests-azure.csv", "--prefill-instances", "1",
     "--decode-instances", "2", "--prefill-tp", "4", "--decode-tp", "2", "--decode-pp", "2"],
    ["llama3-8b", "--mode", "prefill", "--batch", "2", "--prompt", "256", "--tp", "2", "--sp"],
])
def test_readme_commands(tmp_path, args):
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["serve", *args, "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert validate(out, replay=False) == []
    summary = json.loads((out / "summary.json").read_text())
    assert summary["kv_cache"]["blocks"] > 0
    # `stg summary` reads serving sets: a column per rank class, the whole run's FLOPs, the pool
    shown = CliRunner().invoke(app, ["summary", str(out)])
    assert shown.exit_code == 0, shown.output
    flops = summary["rank_classes"][0]["flops"] / 1e12
    assert "whole run, per rank" in shown.output and f"{flops:,.3f}" in shown.output
    assert f"KV cache: {summary['kv_cache']['blocks']:,} blocks" in shown.output


@pytest.mark.parametrize("args, message", [
    (["--mode", "decode", "--batch", "100000"], "batch: 100000 requests"),
    (["--requests", "nowhere.jsonl"], "requests: cannot read nowhere.jsonl"),
    (["--block-size", "0"], "block_size: must be a positive integer"),
    (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization"),
    (["--scheduler", "fcfs", "--mode", "prefill"], "scheduler: must be one of"),
    (["--speculative", "2", "--mode", "prefill"], "speculative: needs a draft model"),
    (["--prefill-tp", "2", "--mode", "prefill"], "prefill_tp: applies to disaggregated serving"),
    (["--sp", "--mode", "prefill"], "sp: sequence parallelism splits a step's tokens over tp"),
    (["--requests", EXAMPLES + "/requests-azure.csv", "--prefill-instances", "1", "--decode-instances", "1",
      "--decode-tp", "3"], "decode_tp: 3 does not divide model llama3-8b's 8 KV heads"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, args, message):
    result = CliRunner().invoke(app, ["serve", "llama3-8b", "-o", str(tmp_path / "o"), *args])
    assert result.exit_code == 2
    assert message in result.output and len(result.output.strip().splitlines()) == 1, result.output
    assert not (tmp_path / "o").exists()


def test_learned_positions_bound_the_sequence(tmp_path):
    result = CliRunner().invoke(app, ["serve", EXAMPLES + "/tiny-gpt.yaml", "--requests", EXAMPLES + "/requests-mooncake.jsonl",
                                      "-o", str(tmp_path / "o")])
    assert result.exit_code == 2 and "exceeds model tiny-gpt's max_positions=1024" in result.output


def test_a_replica_without_requests_is_refused(tmp_path):
    two = tmp_path / "two.jsonl"
    two.write_text('{"timestamp": 0, "input_length": 10, "output_length": 3}\n'
                   '{"timestamp": 5, "input_length": 7, "output_length": 2}\n')
    for flags, field in ((["--dp", "4"], "dp: 4 leaves 2"), (["--prefill-instances", "1", "--decode-instances", "3"],
                                                            "decode_instances: 3 leaves 1")):
        result = CliRunner().invoke(app, ["serve", EXAMPLES + "/tiny-gpt.yaml", "--requests", str(two), *flags,
                                          "-o", str(tmp_path / "o")])
        assert result.exit_code == 2 and field in result.output, result.output
        assert not (tmp_path / "o").exists()
