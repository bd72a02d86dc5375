"""One `stg` command in a child process, so that each measurement has its own peak RSS."""

from __future__ import annotations

import compileall
import functools
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

PACKAGES = ("stg", "model_zoo", "parallelism")


@functools.cache
def compile_bytecode(*folders: Path) -> None:
    """Byte-compile stg's packages (and any `folders`) before the first timed child. An
    installed package has its .pyc files (pip compiles them; an editable install writes them
    on its first run), but an environment with PYTHONDONTWRITEBYTECODE=1, as on the machines
    these benchmarks ran on, never keeps them, and every fresh process recompiles ~16,000
    lines (0.15-0.5 s measured). compileall writes regardless of that variable."""
    packages = [Path(importlib.util.find_spec(name).origin).parent for name in PACKAGES]
    for folder in [*packages, *folders]:
        compileall.compile_dir(str(folder), quiet=1)


def run_stg(args: list[str]) -> tuple[float, float, str]:
    """(wall seconds, peak RSS MB, stdout) of `stg ARGS`; exits naming the command if it fails."""
    compile_bytecode()
    start = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "stg", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out = child.stdout.read().decode()
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    if status:
        raise SystemExit(f"stg {' '.join(args)} failed: {child.stderr.read().decode()}")
    return wall, usage.ru_maxrss / 1024, out
