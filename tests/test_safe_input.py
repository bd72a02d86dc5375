"""Files from other people are data: reading one never runs code, and every way one can be
malformed is a one-line error naming the field (exit code 2)."""

import copy
from pathlib import Path

import pytest
import sympy
import yaml
from typer.testing import CliRunner

from stg.cli import app
from stg.expr import ExprError, check_name, parse_size

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SPEC = yaml.safe_load((EXAMPLES / "parallel-block.yaml").read_text())
H, A = sympy.symbols("H A", positive=True, integer=True)

INJECTIONS = [
    "__import__('os').system('touch PWNED')",
    "(lambda: __import__('os').system('touch PWNED'))()",
    "H.__class__.__bases__",
    "__builtins__",
    "open('PWNED', 'w')",
    "exec('open(\"PWNED\", \"w\")')",
    "[c for c in ().__class__.__base__.__subclasses__()]",
]


def run(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    return result.exit_code, result.output


def one_line_error(code, output):
    lines = output.strip().splitlines()
    return code == 2 and len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in output


@pytest.mark.parametrize("text, value", [("H", H), ("A*H", A * H), ("(H + 2) * 3 - A / 4", (H + 2) * 3 - A / 4),
                                         ("-H", -H), (4096, sympy.Integer(4096)), ("12", sympy.Integer(12))])
def test_size_expressions_over_declared_names(text, value):
    assert parse_size(text, {"H": H, "A": A}) == value


@pytest.mark.parametrize("text", INJECTIONS + ["H ** 2", "H // 2", "1.5 * H", "'H'", "H if A else A", "H[0]",
                                               "x := 3", "", "H, A", "(" * 300 + "H" + ")" * 300, 1.5, None, True])
def test_anything_else_is_refused_without_running(text, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ExprError):
        parse_size(text, {"H": H, "A": A})
    assert not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize("name", ["Q", "I", "N", "O", "pi", "beta", "gamma", "zeta", "lambda", "class", "1H", "x y",
                                  "", "__class__", "_x", "H.real", "é", 3])
def test_names_that_cannot_name_a_dimension(name):
    with pytest.raises(ExprError):
        check_name(name)


def write_model(tmp_path, change) -> Path:
    spec = copy.deepcopy(SPEC)
    change(spec)
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def set_param(shape):
    return lambda spec: spec["blocks"][1]["params"].__setitem__("norm", shape)


@pytest.mark.parametrize("command", ["describe", "generate"])
@pytest.mark.parametrize("injection", INJECTIONS)
def test_a_model_file_never_runs_code(tmp_path, monkeypatch, command, injection):
    monkeypatch.chdir(tmp_path)
    for change in (set_param([injection]), lambda s: s["inputs"].__setitem__("tokens", ["B", injection]),
                   lambda s: s["blocks"][1]["ops"].__setitem__(0, f"h = rmsnorm(x, {injection})")):
        path = write_model(tmp_path, change)
        extra = ["-o", tmp_path / "out", "--seq", "16"] if command == "generate" else []
        code, output = run(command, path, *extra)
        assert one_line_error(code, output), output
        assert not (tmp_path / "PWNED").exists()
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("change, message", [
    (lambda s: s["dims"].__setitem__("Q", ["embed", 8]), "dims: dimension 'Q' is reserved"),
    (lambda s: s["dims"].__setitem__("lambda", ["embed", 8]), "dims: dimension 'lambda' is a Python keyword"),
    (lambda s: s["dims"].__setitem__("1H", ["embed", 8]), "dims: dimension '1H' is not a name"),
    (lambda s: s["dims"].__setitem__("x y", ["embed", 8]), "dims: dimension 'x y' is not a name"),
    (lambda s: s["dims"].__setitem__("", ["embed", 8]), "dims: dimension '' is not a name"),
    (lambda s: s["dims"].__setitem__("tp", ["embed", 8]), "dims: dimension 'tp' is reserved"),
    (lambda s: s["dims"].__setitem__("H", ["embed", 2**63]), "dimension H: size: 9223372036854775808 is too large"),
    (lambda s: s["inputs"].__setitem__("tokens", ["B", "Q"]), "input tokens: shape entry 'Q': unknown name 'Q'"),
    (set_param([]), "shape must be a non-empty list of dimensions, got []"),
    (set_param("H"), "shape must be a non-empty list of dimensions, got 'H'"),
    (lambda s: s["blocks"][1]["ops"].__setitem__(1, "q = einsum(bsh->bs, h)"), "einsum takes 3 argument(s), got 2"),
    (lambda s: s["blocks"][1]["ops"].__setitem__(0, "h = rmsnorm(x)"), "rmsnorm takes 2 argument(s), got 1"),
    (lambda s: s["blocks"][1]["ops"].__setitem__(11, "both = add(attn, mlp, x)"), "add takes 2 argument(s), got 3"),
    (lambda s: s["blocks"][1]["ops"].__setitem__(12, "both = constrain(both, bogus)"),
     "constrain: unknown layout 'bogus'"),
    (lambda s: s["blocks"][1].__setitem__("repeat", "x"), "layers: repeat: must be a positive integer, got 'x'"),
    (lambda s: s["blocks"][1].__setitem__("repeat", -1), "layers: repeat: must be a positive integer, got -1"),
    (lambda s: s["blocks"][1].__setitem__("repeat", 0), "layers: repeat: must be a positive integer, got 0"),
    (lambda s: s["blocks"][1].__setitem__("repeat", 2**63), "layers: repeat: 9223372036854775808 is too large"),
    (lambda s: s.__setitem__("blocks", s["blocks"][:1]), "blocks must be a list of at least two blocks"),
    (lambda s: s["blocks"][2]["ops"].pop(), "no loss"),
])
def test_malformed_graph_models_are_one_line_errors(tmp_path, change, message):
    path = write_model(tmp_path, change)
    code, output = run("generate", path, "-o", tmp_path / "out", "--seq", "16")
    assert one_line_error(code, output), output
    assert message is None or message in output, output
    assert not (tmp_path / "out").exists()
