"""Writing a trace set: stamp every rank from its class skeleton, stream it to disk.

The set is written into a temporary directory beside OUT and renamed into place at the end,
so a failure never leaves a half-written OUT. Memory stays flat in the number of ranks:
one skeleton per (class, hole widths) and one rank's bytes at a time.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Mapping

from stg.chakra.writer import Skeleton, build_skeleton, metadata_record
from stg.errors import OutputError
from stg.groups import GroupIds

Progress = Callable[[int, int], None]


def _prepare(out: Path) -> Path:
    if out.exists() and not out.is_dir():
        raise OutputError(f"output {out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / "workload.json").exists():
        raise OutputError(f"output {out}: a non-empty directory that is not an stg trace set; refusing to replace it")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    except OSError as err:
        raise OutputError(f"output {out}: cannot write there ({err.strerror})") from None
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the set should look like any mkdir
    return tmp


def _commit(tmp: Path, out: Path) -> None:
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        out.rename(old / "set")
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old)


def write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data, indent=1) + "\n")


def write_groups(path: Path, group_ids: GroupIds) -> None:
    """workload.json: {"<id>": [ranks]}, one group a line (it has a line per group of every kind)."""
    with open(path, "w") as f:
        f.write("{\n")
        first = True
        for gid, members in group_ids.table():
            f.write(("" if first else ",\n") + f' "{gid}": {json.dumps(members)}')
            first = False
        f.write("\n}\n")


def write_trace_set(out: Path, workload, summary: Mapping, progress: Progress | None = None) -> None:
    """`workload` (stg.api.Workload) gives the class programs, each rank's class and the
    values that stamp it."""
    out = Path(out)
    tmp = _prepare(out)
    world = workload.mesh.size
    try:
        write_groups(tmp / "workload.json", workload.group_ids)
        write_json(tmp / "summary.json", summary)
        header = metadata_record()
        skeletons: dict[tuple[int, tuple[int, ...]], Skeleton] = {}
        for rank in range(world):
            cls = workload.class_of(rank)
            program = workload.programs[cls]
            values = workload.hole_values(rank, program.holes)
            widths = tuple(len(v) for v in values.values())
            key = (cls, widths)
            if key not in skeletons:
                skeletons[key] = build_skeleton(program.nodes, {h: len(v) for h, v in values.items()})
            with open(tmp / f"workload.{rank}.et", "wb") as f:
                f.write(header)
                f.write(skeletons[key].stamp(values).data)
            if progress:
                progress(rank + 1, world)
        _commit(tmp, out)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise OutputError(f"output {out}: write failed ({err.strerror})") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
