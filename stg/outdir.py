"""The output protocol: OUT holds a complete trace set, the old one or the new one, at every
moment, whatever interrupts the run.

A set is written into `.NAME.partial-PID-XXXX` beside OUT. The swap moves the old set into
`.NAME.old-PID-XXXX/set` and the new folder to OUT: two renames, with SIGINT and SIGTERM held
back until both are done (a signal that arrives in between is delivered after them), and the
old set put back if the second rename fails. A run killed outright (SIGKILL, power loss)
can leave such folders; the next run for the same OUT removes those whose process is gone,
first moving an old set back to OUT if OUT is missing. Only folders of exactly this form,
whose PID is not running, are ever touched.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from stg.errors import OutputError

_HELD = (signal.SIGINT, signal.SIGTERM)


def _stale_pattern(name: str) -> re.Pattern:
    return re.compile(rf"\.{re.escape(name)}\.(partial|old)-(\d+)-[A-Za-z0-9_]+")


def prepare_output(out: Path) -> Path:
    """A fresh, empty folder beside OUT to write the new set into."""
    _refuse_working_directory(out)
    if out.exists() and not out.is_dir():
        raise OutputError(f"output {out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / "workload.json").exists():
        raise OutputError(f"output {out}: a non-empty directory that is not an stg trace set; refusing to replace it")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(out)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-{os.getpid()}-", dir=out.parent))
    except OSError as err:
        raise OutputError(f"output {out}: cannot write there ({err.strerror})") from None
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the set should look like any mkdir
    return tmp


def prepare_range(out: Path) -> Path:
    """OUT itself, for a range of ranks written file by file (`--ranks A:B`)."""
    if out.exists() and not out.is_dir():
        raise OutputError(f"output {out}: exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OutputError(f"output {out}: cannot write there ({err.strerror})") from None
    return out


def commit_output(tmp: Path, out: Path) -> None:
    """The new set at `tmp` becomes OUT; the old set, if any, is removed after the swap."""
    old = None
    try:
        with signals_held():
            if out.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-{os.getpid()}-", dir=out.parent))
                out.rename(old / "set")
            try:
                tmp.rename(out)
            except OSError:
                if old is not None:
                    (old / "set").rename(out)
                raise
    finally:  # also when a held signal is raised on leaving the block: the swap is done by then
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def remove_stale(out: Path) -> None:
    """Remove what interrupted runs for OUT left beside it (their process gone); an old set
    stranded by a run killed mid-swap goes back to OUT if OUT is missing."""
    pattern = _stale_pattern(out.name)
    for entry in sorted(out.parent.iterdir()):
        match = pattern.fullmatch(entry.name)
        if not match or entry.is_symlink() or not entry.is_dir() or _running(int(match.group(2))):
            continue
        stranded = entry / "set"
        if match.group(1) == "old" and not out.exists() and (stranded / "workload.json").is_file():
            stranded.rename(out)
        shutil.rmtree(entry, ignore_errors=True)


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return False  # an earlier call of this process, which is past it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def _refuse_working_directory(out: Path) -> None:
    """Replacing OUT moves it away: if the shell stands in it, `.` would vanish under it."""
    here, target = Path.cwd().resolve(), out.resolve()
    if here == target or target in here.parents:
        raise OutputError(f"output {out}: is or contains the current directory; give a folder outside it")


@contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM wait until the block is done, then act as they would have."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may change handlers; Python runs them there anyway
        return
    caught: list[int] = []
    previous = {sig: signal.signal(sig, lambda number, _frame: caught.append(number)) for sig in _HELD}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sig in dict.fromkeys(caught):
            signal.raise_signal(sig)
