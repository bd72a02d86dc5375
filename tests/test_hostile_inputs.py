"""Hostile inputs found by hand (issue 17): each is one line on stderr and exit code 2 (or 1 for
a trace set that fails validation), never a traceback, a hang or a silent exit 0."""

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from stg import Plan
from stg.api import generate
from stg.cli import app

TINY = {"name": "tiny", "family": "llama", "layers": 2, "hidden": 64, "ffn": 128, "heads": 4, "vocab": 256}
DLRM = {"name": "d", "family": "dlrm", "dense_features": 4, "embedding_dim": 8, "bottom_mlp": [8], "top_mlp": [4, 1],
        "tables": [100, 200]}


def cli(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    return result.exit_code, result.output


def one_line(output, start="error:"):
    lines = output.strip().splitlines()
    return len(lines) == 1 and lines[0].startswith(start) and "Traceback" not in output


@pytest.fixture(scope="module")
def trace_set(tmp_path_factory):
    out = tmp_path_factory.mktemp("sets") / "set"
    generate(TINY, Plan(dp=2, seq=16), out)
    return out


@pytest.fixture
def broken(trace_set, tmp_path):
    copy = tmp_path / "set"
    shutil.copytree(trace_set, copy)
    return copy


# --- finding 6: malformed model and plan files ------------------------------------------------

def write(tmp_path, name, data) -> Path:
    path = tmp_path / name
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return path


@pytest.mark.parametrize("text, message", [
    (b"name: \xff\xfe\n", "not UTF-8 text"),
    ("a: " + "[" * 5000 + "]" * 5000, "model file"),
    ("name: x\nname: y\nfamily: llama\n", "key 'name' is given twice (line 2)"),
    (yaml.safe_dump({**DLRM, "tables": [2**63]}), "tables[0].rows: 9223372036854775808 is too large"),
    (yaml.safe_dump({**TINY, "family": "deepseek", "experts": 4, "top_k": 2, "moe_ffn": 8, "shared_experts": -1,
                     "q_lora_rank": 8, "kv_lora_rank": 8, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
                     "v_head_dim": 8}), "shared_experts: must be an integer >= 0, got -1"),
    (yaml.safe_dump({**TINY, "family": "mixtral"}), "family mixtral is a mixture of experts; give experts"),
    (yaml.safe_dump({**TINY, "family": ["llama"]}), "family must be one of"),
])
def test_malformed_model_files(tmp_path, text, message):
    code, output = cli("generate", write(tmp_path, "model.yaml", text), "-o", tmp_path / "out")
    assert code == 2 and one_line(output) and message in output, output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text, message", [
    (b"dp: \xff\n", "not UTF-8 text"),
    ("dp: " + "[" * 5000 + "]" * 5000, "plan file"),
    ("dp: 2\ndp: 4\n", "key 'dp' is given twice"),
    ("layers_per_stage: 4\npp: 2\n", "layers_per_stage: must be a list of block counts or auto, got 4"),
    ("rules: {mlp: 5}\n", "rules: mlp: must be a mesh axis, a list of them, or null, got 5"),
    ("rules: x\n", "rules: must map logical axes to a mesh axis"),
    ("rules: {bogus: tp}\ntp: 2\n", "rules: bogus: model tiny has no logical axis 'bogus'"),
    ("bucket_mb: .nan\n", "bucket_mb: must be a finite number, got nan"),
    ("capacity_factor: .inf\n", "capacity_factor: must be a finite number, got inf"),
    ("embedding_sharding: ''\n", "embedding_sharding: must be a sharding name or auto, got ''"),
])
def test_malformed_plan_files(tmp_path, text, message):
    model = write(tmp_path, "tiny.yaml", yaml.safe_dump(TINY))
    code, output = cli("generate", model, "--plan", write(tmp_path, "plan.yaml", text), "-o", tmp_path / "out")
    assert code == 2 and one_line(output) and message in output, output
    assert not (tmp_path / "out").exists()


def test_hf_config_files(tmp_path):
    for data, message in ((b"\xff{}", "not UTF-8 text"), (b"[" * 100000 + b"]" * 100000, "HuggingFace config")):
        code, output = cli("generate", write(tmp_path, "config.json", data), "-o", tmp_path / "out")
        assert code == 2 and one_line(output) and message in output, output


# --- finding 7: broken trace sets -------------------------------------------------------------

@pytest.mark.parametrize("damage", ["folder", "dangling", "devzero", "random", "varint"])
def test_broken_rank_files_are_problems_not_tracebacks(broken, damage):
    rank = broken / "workload.1.et"
    if damage == "folder":
        rank.unlink()
        rank.mkdir()
    elif damage == "dangling":
        rank.unlink()
        rank.symlink_to(broken / "nowhere")
    elif damage == "devzero":
        rank.unlink()
        rank.symlink_to("/dev/zero")
    elif damage == "random":  # 100 bytes whose first record length is ~2**56
        with open(rank, "ab") as f:
            f.write(b"\xff" * 7 + b"\x7f" + bytes(range(92)))
    else:
        with open(rank, "ab") as f:
            f.write(b"\xff" * 8 + b"\x01")
    for command in (["validate", broken], ["inspect", rank]):
        code, output = cli(*command)
        assert code in (1, 2) and "Traceback" not in output and output.strip(), output
    code, output = cli("validate", broken)
    reason = "is not a regular file" if damage in ("folder", "dangling", "devzero") else "but the file ends after"
    assert code == 1 and "rank 1" in output and reason in output, output


@pytest.mark.parametrize("content", ["garbage", "{}", "[]", "null", '{"world_size": 2, "rank_classes": 3}'])
def test_a_broken_summary_is_one_line(broken, content):
    (broken / "summary.json").write_text(content)
    code, output = cli("summary", broken)
    assert code == 2 and one_line(output) and "summary.json" in output, output


# --- finding 8: one line, always ----------------------------------------------------------------

@pytest.mark.parametrize("args", [["generate"], ["generate", "llama3-8b", "--dp", "x"], ["generate", "--bogus"],
                                  ["nosuchcommand"], ["schedule", "--pp", "2"], ["inspect"]])
def test_argument_errors_are_one_line(args):
    code, output = cli(*args)
    assert code == 2 and one_line(output), output


def test_errors_do_not_wrap_in_a_narrow_pipe(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "20")
    path = tmp_path / "a-rather-long-name-for-a-file-that-is-not-a-trace-at-all-so-it-must-fail.et"
    path.write_bytes(b"\x05hello")
    code, output = cli("inspect", path)
    assert code == 2 and one_line(output), output


# --- finding 9: contradictory or meaningless options -------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--workers", "0"], "workers: must be a positive integer, got 0"),
    (["--workers", "-1"], "workers: must be a positive integer, got -1"),
    (["--scheduler", "tcp://host:8786"], "scheduler: applies to --executor dask only"),
    (["--ranks", ""], "ranks: expected A:B"),
    (["--embedding-sharding", ""], "embedding_sharding: must be a sharding name"),
    (["--capacity-factor", "2"], "capacity_factor: applies to mixture-of-experts models"),
    (["--expert-skew", "1"], "expert_skew: applies to mixture-of-experts models"),
    (["--schedule", "interleaved", "--vpp", "2"], "vpp=2: virtual stages interleave pipeline stages; they need pp > 1"),
    (["--schedule", "interleaved", "--pp", "2"], "schedule: interleaved runs virtual stages; it needs vpp > 1"),
])
def test_contradictory_generate_options(tmp_path, args, message):
    model = write(tmp_path, "tiny.yaml", yaml.safe_dump(TINY))
    code, output = cli("generate", model, "--seq", "16", "-o", tmp_path / "out", *args)
    assert code == 2 and one_line(output) and message in output, output
    assert not (tmp_path / "out").exists()


def test_contradictory_options_of_other_commands(trace_set):
    code, output = cli("inspect", trace_set / "workload.0.et", "--limit", "-1")
    assert code == 2 and one_line(output) and "limit: must be an integer >= 0" in output
    code, output = cli("describe", "llama3-8b", "--layers", "-1")
    assert code == 2 and one_line(output) and "layers: must be an integer >= 0" in output
    code, output = cli("schedule", "--pp", "2", "--microbatches", "4", "--schedule", "interleaved")
    assert code == 2 and one_line(output) and "needs vpp > 1" in output


# --- finding 4: sizes that used to hang are refused at once ------------------------------------

def test_sizes_that_would_hang_are_refused_fast(tmp_path):
    checks = [
        (["plan-embeddings", "dlrm-kaggle", "--dp", "1000000"], "at most 65,536 ranks for recommendation models"),
        (["generate", "llama3-8b", "--dp", str(2**63), "--count-only"], "dp: 9223372036854775808 is too large"),
        (["generate", "llama3-8b", "--global-batch", str(2**63), "-o", tmp_path / "o"], "global_batch: 922"),
        (["schedule", "--pp", "4", "--microbatches", str(2**63)], "microbatches: 9223372036854775808 is too large"),
        (["schedule", "--pp", str(2**63), "--microbatches", "4"], "pp: 9223372036854775808 is too large"),
        (["generate", write(tmp_path, "deep.yaml", yaml.safe_dump({**TINY, "layers": 2**63})), "--count-only"],
         "layers: 9223372036854775808 is too large"),
        (["generate", write(tmp_path, "big.yaml", yaml.safe_dump({**DLRM, "tables": [1] * 100_001})), "--count-only"],
         "100,001 tables is too many"),
        (["generate", write(tmp_path, "huge.yaml", "# " + "x" * (17 * 2**20)), "--count-only"], "is too large for a"),
    ]
    for args, message in checks:
        code, output = cli(*args)
        assert code == 2 and one_line(output) and message in output, (args, output)


# --- finding 10: DeepSeek-V2-Lite (no query compression) ---------------------------------------

def test_deepseek_without_query_compression(tmp_path):
    config = {"model_type": "deepseek_v3", "_name_or_path": "deepseek-ai/DeepSeek-V2-Lite", "num_hidden_layers": 27,
              "hidden_size": 2048, "intermediate_size": 10944, "num_attention_heads": 16, "num_key_value_heads": 16,
              "vocab_size": 102400, "n_routed_experts": 64, "num_experts_per_tok": 6, "moe_intermediate_size": 1408,
              "n_shared_experts": 2, "first_k_dense_replace": 1, "q_lora_rank": None, "kv_lora_rank": 512,
              "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "tie_word_embeddings": False}
    path = write(tmp_path, "config.json", json.dumps(config))
    code, output = cli("describe", path)
    assert code == 0 and "15,706,484,224 parameters" in output  # the model card's 15.7B
    assert "q_b_nope" not in output and "attn.q_nope" in output


def test_validate_warns_of_an_unknown_schema_version(broken):
    from stg.chakra.writer import metadata_record

    rank = broken / "workload.0.et"
    data = rank.read_bytes()
    header = metadata_record()
    rank.write_bytes(metadata_record("9.9.9") + data[len(header):])
    result = CliRunner().invoke(app, ["validate", str(broken)])
    assert result.exit_code == 0
    assert "warning:" in result.output and "version '9.9.9' is not a Chakra schema version" in result.output
    rank.write_bytes(data)
    assert "warning" not in CliRunner().invoke(app, ["validate", str(broken)]).output


def test_a_bad_dask_scheduler_is_one_line(tmp_path):
    model = write(tmp_path, "tiny.yaml", yaml.safe_dump(TINY))
    code, output = cli("generate", model, "--seq", "16", "--executor", "dask", "--scheduler", "notaurl",
                       "-o", tmp_path / "out")
    assert code == 2 and one_line(output) and "scheduler: cannot connect to 'notaurl'" in output, output
    assert not (tmp_path / "out").exists() and sorted(os.listdir(tmp_path)) == ["tiny.yaml"]
