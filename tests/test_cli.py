import json
import os
import subprocess
import sys

import pytest
import yaml
from typer.testing import CliRunner

from stg.cli import app

runner = CliRunner()
TINY = ["--seq", "32"]


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def write_model(tmp_path, spec):
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.parametrize(
    "args, message",
    [
        (["nope"], "unknown model 'nope'"),
        (["llama3-8b", "--dp", "3", "--global-batch", "32"], "global_batch=32 is not a multiple of micro_batch*dp = 1*3 = 3"),
        (["llama3-8b", "--dp", "0"], "dp: must be a positive integer, got 0"),
        (["llama3-8b", "--seq", "-5"], "seq: must be a positive integer, got -5"),
        (["gpt3-175b", "--seq", "4096"], "seq=4096 exceeds model gpt3-175b's max_positions=2048"),
        (["llama3-8b", "--attention-flops", "half"], "attention_flops: must be one of"),
        (["llama3-8b", "--device", "tpu9"], "device: unknown device 'tpu9'"),
        (["mixtral-8x7b", "--dp", "3", "--ep", "3"], "ep=3 does not divide expert dimension E=8"),
        (["llama3-8b", "--capacity-factor", "0"], "capacity_factor: must be a positive number"),
        (["mixtral-8x7b", "--dp", "2", "--ep", "4"], "ep=4: must divide dp=2"),
        (["mixtral-8x7b", "--dp", "4", "--ep", "4", "--tp", "2", "--etp", "4"], "etp=4: must be 1 or tp=2"),
        (["llama3-8b", "--dtype", "fp64"], "dtype: must be one of ['bf16', 'fp16', 'fp32'], got 'fp64'"),
        (["llama3-8b", "--fp8", "--device", "a100"], "fp8: device a100 has no fp8 tensor cores"),
        (["dlrm-kaggle", "--fp8"], "fp8: applies to transformer models"),
        (["llama3-8b", "--pp", "3"], "pp*vpp=3 does not divide layers=32; give layers_per_stage for an uneven split (a list, or auto"),
        (["llama3-8b", "--pp", "2", "--vpp", "2"], "vpp=2: virtual stages need schedule interleaved"),
        (["llama3-8b", "--pp", "4", "--schedule", "interleaved", "--vpp", "2", "--global-batch", "6"],
         "microbatches=6 must be a multiple of pp=4 for the interleaved schedule"),
        (["llama3-8b", "--tp", "3"], "tp=3 does not divide kv_heads dimension Akv=8"),
        (["llama3-8b", "--sp"], "sp: sequence parallelism splits the sequence over tp, so it needs tp > 1"),
        (["llama3-8b", "--zero", "4"], "zero: must be a ZeRO stage 0, 1, 2 or 3, got 4"),
        (["llama3-8b", "--recompute", "some"], "recompute: must be one of"),
        (["dlrm-kaggle", "--dp", "8", "--embedding-sharding", "sideways"], "embedding_sharding: unknown embedding sharding 'sideways'"),
        (["dlrm-dcnv2", "--dp", "8", "--embedding-memory-gib", "4"], "(40,000,000 rows x 128) fits on no rank under the 4.00 GiB per-rank"),
        (["llama3-8b", "--local-world-size", "8"], "local_world_size: applies to models with embedding tables"),
        (["llama3-8b", "--optimizer", "sgd"], "optimizer: must be one of ['adamw', 'adagrad'], got 'sgd'"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_no_output(tmp_path, args, message):
    out = tmp_path / "out"
    result = run("generate", *args, "-o", out)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output
    assert result.output.strip().count("\n") == 0
    assert not out.exists()
    assert os.listdir(tmp_path) == []  # not even a temporary directory left behind


def test_malformed_and_incomplete_model_yaml(tmp_path, tiny_llama):
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: x\nfamily: llama\nlayers: [\n")
    result = run("generate", broken, "-o", tmp_path / "o")
    assert result.exit_code == 2 and "not valid YAML" in result.output
    incomplete = write_model(tmp_path, {k: v for k, v in tiny_llama.items() if k != "hidden"})
    result = run("generate", incomplete, "-o", tmp_path / "o")
    assert result.exit_code == 2 and "missing field 'hidden'" in result.output
    negative = write_model(tmp_path, {**tiny_llama, "ffn": -1})
    result = run("generate", negative, "-o", tmp_path / "o")
    assert result.exit_code == 2 and "ffn: must be a positive integer, got -1" in result.output


def test_unwritable_output(tmp_path, tiny_llama):
    model = write_model(tmp_path, tiny_llama)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    result = run("generate", model, "-o", blocker / "out", *TINY)
    assert result.exit_code == 2 and "cannot write there" in result.output
    result = run("generate", model, "-o", blocker, *TINY)
    assert result.exit_code == 2 and "is not a directory" in result.output
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "precious.txt").write_text("keep me")
    result = run("generate", model, "-o", foreign, *TINY)
    assert result.exit_code == 2 and "refusing to replace it" in result.output
    assert (foreign / "precious.txt").read_text() == "keep me"


def test_plan_file_and_overrides(tmp_path, tiny_llama):
    model = write_model(tmp_path, tiny_llama)
    plan = tmp_path / "plan.yaml"
    plan.write_text("dp: 2\nglobal_batch: 8\nseq: 32\n")
    out = tmp_path / "out"
    assert run("generate", model, "--plan", plan, "-o", out, "-q").exit_code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["microbatches"] == 4
    assert run("generate", model, "--plan", plan, "--dp", "4", "-o", out, "-q").exit_code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["microbatches"] == 2  # replaced in place
    plan.write_text("dp: 2\nbatch: 8\n")
    result = run("generate", model, "--plan", plan, "-o", out)
    assert result.exit_code == 2 and "unknown key(s) ['batch']" in result.output


def stg_process(*args, hash_seed: str):
    """`stg ARGS` in a fresh interpreter with its own string-hash seed: set and dict order of
    strings differ between the runs, as they would between two users' machines."""
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    return subprocess.run([sys.executable, "-m", "stg", *map(str, args)], env=env, capture_output=True, text=True)


def test_two_runs_are_byte_identical(tmp_path, tiny_gpt):
    model = write_model(tmp_path, {**tiny_gpt, "layers": 4})
    for name, seed in (("a", "1"), ("b", "2")):
        done = stg_process("generate", model, "-o", tmp_path / name, "--dp", "2", "--pp", "2", "--global-batch", "4",
                           *TINY, "-q", hash_seed=seed)
        assert done.returncode == 0, done.stderr
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert len(files) == 6
    for name in files:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_validate_passes_generated_and_fails_broken(tmp_path, tiny_llama):
    model = write_model(tmp_path, tiny_llama)
    out = tmp_path / "out"
    assert run("generate", model, "-o", out, "--dp", "2", *TINY, "-q").exit_code == 0
    result = run("validate", out)
    assert result.exit_code == 0 and "ok: 2 ranks" in result.output
    # drop rank 1's last collective: the group's sequences no longer match
    from stg.chakra.reader import read_trace, write_trace

    trace = read_trace(out / "workload.1.et")
    last_coll = max(n.id for n in trace.nodes if n.type == 7)
    kept = [n for n in trace.nodes if n.id != last_coll]
    for node in kept:
        node.data_deps[:] = [d for d in node.data_deps if d != last_coll]
    write_trace(out / "workload.1.et", trace.metadata, kept)
    result = run("validate", out)
    assert result.exit_code == 1
    assert "rank 1" in result.output and "group 1" in result.output


def test_models_and_inspect_and_describe(tmp_path, tiny_llama):
    result = run("models", "--json")
    rows = json.loads(result.output)
    assert {"name": "llama3-8b", "params": 8_030_261_248}.items() <= next(r for r in rows if r["name"] == "llama3-8b").items()
    model = write_model(tmp_path, tiny_llama)
    out = tmp_path / "out"
    run("generate", model, "-o", out, *TINY, "-q")
    lines = run("inspect", out / "workload.0.et", "--json", "--limit", "3").output.splitlines()
    assert [json.loads(line)["id"] for line in lines] == [0, 1, 2]
    text = run("describe", model).output
    assert "einsum[bsh,hf->bsf]" in text and "parameters" in text
    assert run("inspect", tmp_path / "missing.et").exit_code == 2


def test_console_script_reports_errors_without_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "stg", "generate", "llama3-8b", "--dp", "3", "--global-batch", "4", "-o", str(tmp_path / "o")],
        capture_output=True, text=True,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("error: global_batch=4 is not a multiple")
    assert "Traceback" not in result.stderr


def test_summary_command(tmp_path, tiny_llama):
    model = write_model(tmp_path, tiny_llama)
    out = tmp_path / "out"
    assert run("generate", model, "-o", out, "--dp", "2", "--tp", "2", "--zero", "1", *TINY, "-q").exit_code == 0
    one = json.loads(run("summary", out, "--rank", "3", "--json").output)
    assert one["rank"] == 3 and set(one["memory"]) == {"weights", "gradients", "optimizer_states", "activations", "peak"}
    assert one["comm_bytes"]["REDUCE_SCATTER"] > 0
    text = run("summary", out).output
    assert "memory peak GiB" in text and "REDUCE_SCATTER" in text
    assert run("summary", out, "--rank", "9").exit_code == 2
    assert run("summary", tmp_path).exit_code == 2


def test_plan_embeddings_prints_the_placement(tmp_path):
    result = run("plan-embeddings", "dlrm-kaggle", "--dp", "4", "--embedding-sharding", "table_wise", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert len(data["tables"]) == 26 and len(data["ranks"]) == 4
    # every table whole on one rank: the ranks' tables add up to all of them (16 fp32 + 1 state per row)
    assert sum(r["weights"] for r in data["ranks"]) == 33762577 * 16 * 4
    assert {row["sharding"] for row in data["tables"]} == {"table_wise"}
    table = run("plan-embeddings", "dlrm-kaggle", "--dp", "2", "--local-world-size", "4")
    assert table.exit_code == 0 and "8 ranks; embedding memory per rank" in table.output
    out = tmp_path / "out"
    assert run("generate", "dlrm-kaggle", "--dp", "4", "--micro-batch", "8", "-o", out, "-q").exit_code == 0
    shown = run("summary", out)
    assert shown.exit_code == 0 and "memory embedding_weights GiB" in shown.output


def test_help_prints_every_option_with_its_default():
    text = run("generate", "--help").output
    for option in ("--dp", "--embedding-sharding", "--local-world-size", "--optimizer", "--count-only"):
        assert option in text
    # help texts print as written (rich markup would drop "[default: 1]", markdown "<rank>")
    assert "world = tp x cp x pp x dp. [default: 1]" in " ".join(text.split())
    assert "OUT/workload.<rank>.et" in text



def test_generate_help_groups_options_in_panels():
    text = run("generate", "--help").output
    headings = [line[:-1] for line in text.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert headings == ["Model & batch", "Parallelism", "Memory & precision", "MoE", "Recommendation models",
                        "Output & scale", "Options"]
    parallelism = text[text.index("\nParallelism:"):text.index("\nMemory & precision:")]
    assert "--dp" in parallelism and "--layers-per-stage" in parallelism and "--ep" not in parallelism
    assert "[default: 1f1b]" in " ".join(parallelism.split())


def test_count_only_needs_no_output(tmp_path, tiny_llama):
    model = write_model(tmp_path, tiny_llama)
    result = run("generate", model, "--dp", "2", *TINY, "--count-only")
    assert result.exit_code == 0 and json.loads(result.output)["ranks"] == 2
    result = run("generate", model, "--dp", "2", *TINY)
    assert result.exit_code == 2 and "give an output directory" in result.output


def test_an_old_plan_file_giving_dp_and_ep_fails_with_the_conversion(tmp_path):
    plan = tmp_path / "old.yaml"
    plan.write_text("dp: 2\nep: 4\n")  # written when the world was dp x ep = 8 ranks
    result = run("generate", "mixtral-8x7b", "--plan", plan, "-o", tmp_path / "out")
    assert result.exit_code == 2 and result.output.strip().count("\n") == 0
    assert "write dp: 8; then add plan_version: 2" in result.output


def test_the_command_ends_without_teardown_and_its_output_whole():
    """`stg` ends with os._exit after flushing (stg.cli.main: no interpreter teardown): what it
    printed to a pipe arrives whole, and its exit codes are click's and stg's own."""
    counted = stg_process("generate", "llama3-8b", "--dp", "8", "--global-batch", "8", "--seq", "128",
                          "--count-only", hash_seed="0")
    assert counted.returncode == 0 and json.loads(counted.stdout)["ranks"] == 8
    refused = stg_process("generate", "llama3-8b", "--tp", "3", "--global-batch", "8", "--count-only", hash_seed="0")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "tp=3" in refused.stderr
    helped = stg_process("--help", hash_seed="0")
    assert helped.returncode == 0 and "generate" in helped.stdout
