"""Interrupts never lose a set: OUT holds the old set or the new one, complete, at every
moment; what interrupted runs leave beside it is cleaned up by the next run."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stg import Plan
from stg.api import generate
from stg.chakra.validate import validate
from stg.cli import app
from stg.interrupts import Interrupted

TINY = {"name": "tiny", "family": "llama", "layers": 2, "hidden": 64, "ffn": 128, "heads": 4, "vocab": 256}


def seq_of(out: Path) -> int:
    return json.loads((out / "summary.json").read_text())["plan"]["seq"]


def beside(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name != out.name)


@pytest.fixture
def raising_handlers():
    """SIGINT and SIGTERM raise Interrupted, as under the `stg` command."""
    previous = {sig: signal.signal(sig, lambda n, _f: (_ for _ in ()).throw(Interrupted(n)))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in previous.items():
        signal.signal(sig, handler)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.parametrize("at", [0, 1])  # before the old set moves away; between the two renames
def test_a_signal_at_the_swap_leaves_a_complete_set(tmp_path, monkeypatch, raising_handlers, sig, at):
    out = tmp_path / "set"
    generate(TINY, Plan(seq=16), out)
    renames = []
    original = Path.rename

    def rename(self, target):
        renames.append(self)
        if len(renames) - 1 == at:
            os.kill(os.getpid(), sig)
        return original(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(Interrupted):
        generate(TINY, Plan(seq=32), out)
    monkeypatch.undo()
    assert len(renames) == 2  # the swap finished before the signal took effect
    assert seq_of(out) == 32 and validate(out) == []
    assert beside(out) == []


def test_a_failed_swap_puts_the_old_set_back(tmp_path, monkeypatch):
    out = tmp_path / "set"
    generate(TINY, Plan(seq=16), out)
    original = Path.rename

    def rename(self, target):
        if ".partial-" in self.name:
            raise OSError(28, "No space left on device")
        return original(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(Exception, match="No space left on device"):
        generate(TINY, Plan(seq=32), out)
    monkeypatch.undo()
    assert seq_of(out) == 16 and validate(out) == []
    assert beside(out) == []


def test_the_next_run_cleans_up_after_killed_runs(tmp_path):
    out = tmp_path / "set"
    generate(TINY, Plan(seq=16), out)
    gone = 99_999_999  # above any pid_max: no such process
    stranded = tmp_path / f".set.old-{gone}-abc123"
    stranded.mkdir()
    out.rename(stranded / "set")  # killed between the two renames: OUT is missing
    (tmp_path / f".set.partial-{gone}-xyz_9").mkdir()
    alive = tmp_path / f".set.partial-{os.getppid()}-live"  # another run still writing
    alive.mkdir()
    foreign = [tmp_path / f".other.partial-{gone}-abc", tmp_path / ".set.partial-notapid", tmp_path / "keep"]
    for folder in foreign:
        folder.mkdir()
    code = CliRunner().invoke(app, ["generate", "nope", "-o", str(out)]).exit_code
    assert code == 2  # bad input: nothing written, nothing cleaned
    assert not out.exists() and stranded.exists()
    model = tmp_path / "tiny.yaml"
    model.write_text(json.dumps(TINY))
    result = CliRunner().invoke(app, ["generate", str(model), "--seq", "32", "-o", str(out), "-q"])
    assert result.exit_code == 0, result.output
    assert seq_of(out) == 32 and validate(out) == []
    assert beside(out) == sorted(p.name for p in [alive, *foreign, model])


@pytest.mark.parametrize("where", [".", "sub", "../set"])
def test_the_output_may_not_hold_the_working_directory(tmp_path, monkeypatch, where):
    out = tmp_path / "set"
    generate(TINY, Plan(seq=16), out)
    (out / "sub").mkdir()
    monkeypatch.chdir(out / "sub" if where != "." else out)
    target = {"sub": str(out), ".": ".", "../set": "../../set"}[where]
    result = CliRunner().invoke(app, ["generate", "llama3-8b", "-o", target])
    assert result.exit_code == 2 and "is or contains the current directory" in result.output, result.output
    assert seq_of(out) == 16 and beside(out) == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupting_the_command_mid_write_is_quiet_and_keeps_the_old_set(tmp_path, sig):
    """A real `stg generate` with worker processes, signalled while the workers write (the whole
    process group, as Ctrl-C does): one line, exit 128 + signal, the old set intact, and the
    partial folder gone."""
    out = tmp_path / "set"
    generate(TINY, Plan(seq=16), out)
    model = tmp_path / "tiny.yaml"
    model.write_text(json.dumps(TINY))
    command = [sys.executable, "-m", "stg", "generate", str(model), "--dp", "4096", "--seq", "64", "-o", str(out),
               "--workers", "2", "-q"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and process.poll() is None:
        partial = [p for p in tmp_path.glob(".set.partial-*") if len(os.listdir(p)) > 50]
        if partial:
            break
        time.sleep(0.02)
    assert partial, "the run ended before it could be interrupted"
    os.killpg(process.pid, sig)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 128 + sig and stderr.strip() == f"interrupted ({signal.Signals(sig).name})", stderr
    assert seq_of(out) == 16 and validate(out, replay=False) == []
    assert beside(out) == ["tiny.yaml"]


def test_a_failed_range_removes_its_unfinished_files_and_no_one_elses(tmp_path, monkeypatch):
    """`--ranks A:B` writes file by file into OUT; a write that fails leaves nothing of its
    own half-written there, while another writer's unfinished file (another process writing
    another range into the same OUT) stays."""
    out = tmp_path / "out"
    out.mkdir()
    other = out / ".workload.7.et.partial-1"  # pid 1 is never this test
    other.write_bytes(b"another writer's")
    replace = Path.replace

    def full_disk(self, target):
        if ".partial-" in self.name and self.name.startswith(".workload.2."):
            raise OSError(28, "No space left on device")
        return replace(self, target)

    monkeypatch.setattr(Path, "replace", full_disk)
    with pytest.raises(Exception, match="write failed \\(No space left on device\\)"):
        generate(TINY, Plan(dp=8, global_batch=8, seq=32), out, ranks=range(0, 4))
    names = sorted(p.name for p in out.iterdir())
    assert names == [".workload.7.et.partial-1", "summary.json", "workload.0.et", "workload.1.et", "workload.json"]


@pytest.mark.parametrize("ranks", [None, range(0, 8)])
def test_a_write_that_fails_in_a_worker_is_the_same_error_and_leaves_nothing(tmp_path, monkeypatch, ranks):
    """With --workers the ranks are written in forked processes: a full disk there is the same
    one-line error as in the parent, and the set's temporary folder (or a range's unfinished
    files) is gone once every worker has stopped."""
    out = tmp_path / "out"
    replace = Path.replace

    def full_disk(self, target):  # forked workers inherit the patch
        if self.name.startswith(".workload.5."):
            raise OSError(28, "No space left on device")
        return replace(self, target)

    monkeypatch.setattr(Path, "replace", full_disk)
    with pytest.raises(Exception, match="write failed \\(No space left on device\\)"):
        generate(TINY, Plan(dp=16, global_batch=16, seq=32), out, ranks=ranks, workers=2)
    if ranks is None:
        assert list(tmp_path.iterdir()) == []  # no OUT, no temporary folder
    else:  # the range's finished files may stay, its unfinished ones not
        finished = {f"workload.{rank}.et" for rank in ranks if rank != 5}
        assert {p.name for p in out.iterdir()} - finished == {"summary.json", "workload.json"}
