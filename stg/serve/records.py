"""Per-iteration records, streamed to OUT/iterations.jsonl instead of held in summary.json.

A serving set records every iteration (its requests, sizes, blocks, start and end); held as
Python dicts until summary.json is written they grew the memory with the iterations (98 MB at
1,000 decode steps, 141 MB at 10,000). They go to `iterations.jsonl` as they are produced,
one JSON object a line: `{"replica": r, ...}` (or `"instance": k` for disaggregated sets)
followed by the fields of Timed.to_dict(), a replica's (instance's) lines together and in
order. summary.json names the file (`"iterations_file"`) and gives each replica (instance)
`"iterations": {"file": "iterations.jsonl", "first_line": n, "count": m}`.

The summary that generate_serving returns holds an IterationLog in the same place: a
read-only sequence (len, index, iterate) that reads its lines back from the written file, so
callers keep writing summary["replicas"][0]["iterations"][0]["tokens"].
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

FILE = "iterations.jsonl"


class IterationLog(Sequence):
    """One replica's (instance's) iteration records in OUT/iterations.jsonl, read on demand."""

    def __init__(self, path: Path, first_line: int, offsets: np.ndarray):
        self.path, self.first_line, self.offsets = Path(path), first_line, offsets  # offsets: count + 1 byte positions

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        with open(self.path, "rb") as f:
            f.seek(int(self.offsets[index]))
            return json.loads(f.read(int(self.offsets[index + 1] - self.offsets[index])))

    def __iter__(self):
        with open(self.path, "rb") as f:
            f.seek(int(self.offsets[0]))
            for _ in range(len(self)):
                yield json.loads(f.readline())

    def reference(self) -> dict:
        """What summary.json holds in its place."""
        return {"file": FILE, "first_line": self.first_line, "count": len(self)}


def write_iterations(folder: Path, out: Path, runs, key: str) -> list[IterationLog]:
    """Write each run's records (a sequence of Timed, `key` "replica" or "instance") to
    folder/iterations.jsonl, one line at a time; the logs read them from out/iterations.jsonl
    (where the folder is committed)."""
    logs, position, line = [], 0, 0
    with open(Path(folder) / FILE, "wb") as f:
        for index, timed in enumerate(runs):
            offsets = np.empty(len(timed) + 1, dtype=np.int64)
            offsets[0] = position
            for i, t in enumerate(timed):
                data = (json.dumps({key: index, **t.to_dict()}, separators=(",", ":")) + "\n").encode()
                f.write(data)
                position += len(data)
                offsets[i + 1] = position
            logs.append(IterationLog(Path(out) / FILE, line, offsets))
            line += len(timed)
    return logs


def dump_summary(path: Path, summary: dict) -> None:
    """summary.json, each IterationLog written as its reference."""
    with open(path, "w") as f:
        json.dump(summary, f, indent=1, default=_reference)
        f.write("\n")


def _reference(value):
    if isinstance(value, IterationLog):
        return value.reference()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")
