"""Writing a trace set: stamp every rank from its class skeleton, stream it to disk.

The set is written into a temporary directory beside OUT and swapped into place at the end
(stg/outdir.py), so a failure or an interrupt never leaves a half-written or missing OUT. Memory stays flat in the number of ranks:
one skeleton per (class, hole widths) and one rank's bytes at a time.
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import closing
from dataclasses import replace
from pathlib import Path
from typing import Callable, Mapping, Sequence

from stg.chakra.writer import Skeleton, StreamShape, build_skeleton, metadata_record, stream_length, stream_shape
from stg.errors import OutputError
from stg.groups import GroupIds
from stg.outdir import commit_output, prepare_output, prepare_range
from stg.workers import forked_map

Progress = Callable[[int, int], None]


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


class Stamper:
    """Each rank's file from its class skeleton: one skeleton per class, built on first use
    (every rank of a class has holes of the same widths, so one layout serves them all)."""

    def __init__(self, workload):
        self.workload = workload
        self.header = metadata_record()
        self.skeletons: dict[int, Skeleton] = {}
        # a file being written is .NAME.partial-PID, PID the writing command's (its forked
        # workers' too), so a failed range removes its own leftovers and no other writer's
        self.owner = os.getpid()

    def skeleton(self, cls: int, values: Mapping) -> Skeleton:
        if cls not in self.skeletons:
            program = self.workload.programs[cls]
            self.skeletons[cls] = build_skeleton(program.nodes, {h: len(v) for h, v in values.items()})
        return self.skeletons[cls]

    def prepare(self, ranks: range, workers: int) -> None:
        """Build the skeletons of the classes that `ranks` holds a representative of, in
        `workers` forked processes when there are several (each class's independently), before
        the writers fork, so that they share them (a class without one is built on use)."""
        classes = [cls for cls in range(len(self.workload.programs)) if self.workload.representative(cls) in ranks]
        with closing(forked_map(self._built, classes, workers)) as built:
            for index, skeleton in built:
                self.skeletons[classes[index]] = skeleton

    def _built(self, cls: int) -> Skeleton:
        values = self.workload.hole_values(self.workload.representative(cls), self.workload.programs[cls].holes)
        return self.skeleton(cls, values)

    def rank_bytes(self, rank: int):
        cls = self.workload.class_of(rank)
        values = self.workload.hole_values(rank, self.workload.programs[cls].holes)
        return self.skeleton(cls, values).stamp(values)

    def write(self, folder: Path, ranks: range) -> int:
        for rank in ranks:
            _write_atomic(folder / f"workload.{rank}.et", self.owner, self.header, self.rank_bytes(rank).data)
        return len(ranks)


def _write_atomic(path: Path, owner: int, *chunks) -> None:
    partial = path.with_name(f".{path.name}.partial-{owner}")
    with open(partial, "wb") as f:
        for chunk in chunks:
            f.write(chunk)
    partial.replace(path)


_FORKED: Stamper | None = None  # the parent's stamper, inherited by forked workers


def _write_chunk(job: tuple[str, int, int]) -> int:
    folder, start, stop = job
    return _FORKED.write(Path(folder), range(start, stop))


def split_ranks(ranks: range, pieces: int) -> list[range]:
    size = max(1, -(-len(ranks) // pieces))
    return [range(start, min(start + size, ranks.stop)) for start in range(ranks.start, ranks.stop, size)]


def write_trace_set(out: Path, workload, summary: Mapping, progress: Progress | None = None, *,
                    ranks: range | None = None, workers: int = 1,
                    before_summary: Callable[[Path], None] | None = None) -> None:
    """Write `workload` (stg.api.Workload) to OUT: workload.json, summary.json and the rank
    files of `ranks` (default all). A full set goes to a temporary directory renamed into
    place; a range (`--ranks A:B`, to split a set over machines) is written file by file,
    each atomically, into OUT, and its files equal those of a full run byte for byte.
    `workers` > 1 stamps ranks in that many forked processes. `before_summary(folder)` may
    write more files into the set (and complete the summary) before summary.json is written."""
    global _FORKED
    out = Path(out)
    world = workload.mesh.size
    ranks = range(world) if ranks is None else ranks
    whole = ranks == range(world)
    folder = prepare_output(out) if whole else prepare_range(out)
    stamper = Stamper(workload)
    try:
        write_groups(folder / "workload.json", workload.group_ids)
        if before_summary is not None:
            before_summary(folder)
        write_json(folder / "summary.json", summary)
        stamper.prepare(ranks, workers)
        done = 0
        jobs = [(str(folder), c.start, c.stop) for c in split_ranks(ranks, max(1, workers) * 8)]
        _FORKED = stamper
        with closing(forked_map(_write_chunk, jobs, workers)) as written:  # the workers end with the block
            for _, count in written:
                done += count
                if progress:
                    progress(done, len(ranks))
        if whole:
            commit_output(folder, out)
    except OSError as err:  # here or in a worker
        _discard(folder, whole, stamper)
        raise OutputError(f"output {out}: write failed ({err.strerror})") from None
    except BaseException:
        _discard(folder, whole, stamper)
        raise
    finally:
        _FORKED = None


def _discard(folder: Path, whole: bool, stamper: Stamper) -> None:
    """After a failure: a whole set's temporary folder, or a range's unfinished files (the
    workers have stopped by now: they end with forked_map's block, before the exception gets here)."""
    if whole:
        shutil.rmtree(folder, ignore_errors=True)
        return
    for leftover in folder.glob(f".workload.*.et.partial-{stamper.owner}"):
        leftover.unlink(missing_ok=True)


Counted = tuple[int, StreamShape]  # a class's nodes: how many, and its stream's shape


def count_trace_set(workload, counted: Sequence[Counted]) -> dict:
    """What a full write would produce, without writing: bytes and nodes, per class and in all,
    from each class's counted nodes (lower_counted)."""
    header = len(metadata_record())
    classes = []
    for cls, (program, (nodes, shape)) in enumerate(zip(workload.programs, counted)):
        values = workload.hole_values(workload.representative(cls), program.holes)
        classes.append({"class": cls, "ranks": workload.class_count(cls),
                        "bytes_per_rank": header + stream_length(shape, {h: len(v) for h, v in values.items()}),
                        "nodes_per_rank": nodes})
    return {
        "ranks": workload.mesh.size,
        "bytes": sum(c["ranks"] * c["bytes_per_rank"] for c in classes),
        "nodes": sum(c["ranks"] * c["nodes_per_rank"] for c in classes),
        "classes": classes,
    }


_JOBS: Sequence[Callable] = ()  # the parent's lowering jobs, inherited by forked workers


def _count_class(index: int):
    program = _JOBS[index]()
    counted = len(program.nodes), stream_shape(program.nodes)
    return replace(program, nodes=(), counted_holes=frozenset(program.holes)), counted


def lower_counted(jobs: Sequence[Callable], workers: int) -> tuple[list, list[Counted]]:
    """Run `jobs` (each lowers one rank class with its nodes), in `workers` forked processes
    when there are several, each class's nodes counted where they are made and dropped there:
    (the programs without their nodes, each class's Counted). The classes lower independently
    of each other, so a count takes about 1/workers of their time."""
    global _JOBS
    _JOBS = jobs
    try:
        with closing(forked_map(_count_class, range(len(jobs)), workers)) as finished:
            done = [result for _, result in sorted(finished, key=lambda pair: pair[0])]
    finally:
        _JOBS = ()
    return [program for program, _ in done], [counted for _, counted in done]
