"""Property-based fuzzing of everything a user hands stg: model files, plan files, CLI values.

Whatever the input, `stg generate` exits 0 or 2; on 2 it prints exactly one line starting
`error:`, leaves nothing at -o and runs no code of the input's; on 0 the set passes
`stg validate`. Examples are derandomized (the same cases every run) and few, to keep CI
fast; benchmarks/fuzz.py runs the same properties with many random examples.
"""

from __future__ import annotations

import copy
import os
from collections import Counter
import tempfile
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from stg.chakra.validate import validate
from stg.cli import app

CI = settings(max_examples=100, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow])

TINY = {"name": "tiny", "family": "llama", "layers": 2, "hidden": 64, "ffn": 128, "heads": 4, "vocab": 256}
GRAPH = {
    "name": "g", "family": "graph",
    "dims": {"H": ["embed", 8], "V": ["vocab", 16]},
    "inputs": {"tokens": ["B", "S"], "labels": ["B", "S"]},
    "blocks": [
        {"name": "embed", "params": {"table": ["V", "H"]}, "ops": ["x = embedding(table, tokens)"]},
        {"name": "layers", "repeat": 1, "params": {"w": ["H", "H"]},
         "ops": ["y = einsum(bsh,hk->bsk, x, w)", "x = add(x, y)"]},
        {"name": "head", "params": {"out": ["V", "H"]},
         "ops": ["logits = einsum(bsh,vh->bsv, x, out)", "loss = cross_entropy(logits, labels)"]},
    ],
}
MARKER = "PWNED"
INJECTIONS = [f"__import__('os').system('touch {MARKER}')", f"open('{MARKER}', 'w')", "lambda: 0", "H.__class__",
              "__builtins__", "(lambda: 1)()", "H**99999999", "9" * 5000, "Q", "E", "I", "pi", "oo", "nan", "zoo"]

# numbers and values that are wrong in every field, or right only where small
NUMBERS = st.sampled_from([0, -1, 1, 2, 3, 8, 2**31, 2**63, 2**64, 10**30, 1.5, 1e308, float("nan"), float("inf"),
                           -float("inf"), 1e-9, True, None, "", "x", "2**63", [], {}, [1, 2]])
TEXT = st.one_of(st.sampled_from(INJECTIONS), st.text(alphabet="HVBSxk_()'.,*+-/ 0123456789:[]{}\"@#;=", max_size=24))
SMALL = st.sampled_from([1, 2, 4, 8, 16])  # valid in most fields: enough cases reach a written set
VALUES = st.one_of(SMALL, NUMBERS, TEXT, st.lists(st.one_of(NUMBERS, TEXT), max_size=3))


OUTCOMES: Counter = Counter()  # exit code -> cases (benchmarks/fuzz.py reports it)


def run_generate(*args: str, files: dict[str, bytes | str] = {}) -> None:
    """The property: run `stg generate ARGS -o OUT` in a fresh folder holding `files`."""
    with tempfile.TemporaryDirectory() as folder:
        here = os.getcwd()
        os.chdir(folder)
        try:
            for name, data in files.items():
                Path(name).write_bytes(data if isinstance(data, bytes) else data.encode())
            result = CliRunner().invoke(app, ["generate", *args, "-o", "out", "-q", "--workers", "1"])
            assert result.exit_code in (0, 2), (args, result.output, result.exception)
            OUTCOMES[result.exit_code] += 1
            assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
            assert "Traceback" not in result.output, result.output
            assert not Path(MARKER).exists(), "an input ran code"
            if result.exit_code == 2:
                lines = result.output.strip().splitlines()
                assert len(lines) == 1 and lines[0].startswith("error:"), result.output
                assert not Path("out").exists() and sorted(os.listdir()) == sorted(files)
            else:
                assert validate(Path("out")) == []
        finally:
            os.chdir(here)


def mutate(base: dict, path: list, value) -> dict:
    spec = copy.deepcopy(base)
    node = spec
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return spec


GRAPH_PLACES = [["dims", "H"], ["dims", "H", 1], ["dims", "H", 0], ["dims", "V", 1], ["inputs", "tokens"],
                ["inputs", "tokens", 1], ["blocks", 1, "repeat"], ["blocks", 1, "params", "w"],
                ["blocks", 1, "params", "w", 0], ["blocks", 1, "ops", 0], ["blocks", 1, "ops", 1],
                ["blocks", 2, "ops", 1], ["blocks", 1, "params"], ["blocks", 1], ["blocks"], ["name"], ["family"]]


@st.composite
def model_files(draw) -> bytes | str:
    kind = draw(st.sampled_from(["llama", "graph", "graph", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    if kind == "llama":
        keys = [*TINY, "experts", "top_k", "kv_heads", "head_dim", "dropout", "shared_experts", "max_positions"]
        spec = mutate(TINY, [draw(st.sampled_from(keys))], draw(VALUES))
    else:
        spec = mutate(GRAPH, draw(st.sampled_from(GRAPH_PLACES)), draw(VALUES))
        if draw(st.booleans()):  # a second change: a dimension name, or another place
            name = draw(TEXT)
            spec["dims"][name] = spec["dims"].pop("H", ["embed", 8])
    return yaml.safe_dump(spec)


PLAN_KEYS = ["dp", "tp", "pp", "cp", "ep", "vpp", "schedule", "layers_per_stage", "zero", "sp", "recompute",
             "micro_batch", "global_batch", "seq", "capacity_factor", "expert_skew", "bucket_mb", "rules",
             "make_vocab_divisible_by", "grad_dtype", "optimizer", "device", "attention_flops", "bogus"]


PLANS = st.dictionaries(st.sampled_from(PLAN_KEYS), VALUES, max_size=3)
OPTIONS = ["--dp", "--tp", "--pp", "--vpp", "--cp", "--ep", "--zero", "--micro-batch", "--global-batch", "--seq",
           "--capacity-factor", "--expert-skew", "--bucket-mb", "--schedule", "--layers-per-stage", "--ranks",
           "--workers", "--make-vocab-divisible-by", "--recompute", "--device", "--embedding-sharding",
           "--local-world-size", "--embedding-memory-gib", "--scheduler"]
CLI_VALUES = st.lists(st.tuples(st.sampled_from(OPTIONS), st.one_of(SMALL, NUMBERS, TEXT).map(str)), max_size=3)


def check_model_file(text: bytes | str) -> None:
    run_generate("model.yaml", "--seq", "16", files={"model.yaml": text})


def check_plan_file(plan: dict, as_bytes: bool) -> None:
    text = yaml.safe_dump(plan)
    files = {"model.yaml": yaml.safe_dump(TINY), "plan.yaml": text.encode("utf-16") if as_bytes else text}
    run_generate("model.yaml", "--plan", "plan.yaml", "--seq", "16", files=files)


def check_cli_values(options: list[tuple[str, str]]) -> None:
    args = [part for option, value in options for part in (option, value)]
    run_generate("tiny.yaml", "--seq", "16", *args, files={"tiny.yaml": yaml.safe_dump(TINY)})


@CI
@given(model_files())
def test_hostile_model_files(text):
    check_model_file(text)


@CI
@given(PLANS, st.booleans())
def test_hostile_plan_files(plan, as_bytes):
    check_plan_file(plan, as_bytes)


@CI
@given(CLI_VALUES)
def test_hostile_cli_values(options):
    check_cli_values(options)
