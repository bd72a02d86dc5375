"""One `stg` command in a child process, so that each measurement has its own peak RSS."""

from __future__ import annotations

import os
import subprocess
import sys
import time


def run_stg(args: list[str]) -> tuple[float, float, str]:
    """(wall seconds, peak RSS MB, stdout) of `stg ARGS`; exits naming the command if it fails."""
    start = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "stg", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out = child.stdout.read().decode()
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    if status:
        raise SystemExit(f"stg {' '.join(args)} failed: {child.stderr.read().decode()}")
    return wall, usage.ru_maxrss / 1024, out
