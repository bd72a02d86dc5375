"""Before a set is written: replay one pipeline slice of the rank-class programs.

A slice is one rank per pipeline stage with the same coordinates on every other mesh axis
(for each variant: an expert slot, an embedding slot). It holds every send/recv pattern of
the set and every collective over pipeline stages (the tied-embedding group). A collective
over other axes (tp, dp, cp, ep, ...) joins ranks of other slices that run the same class
programs in the same order, so in a zero-time replay it completes when this slice's member
issues it; the slice then wedges exactly when the whole set does on account of the pipeline
or of one rank's own order. The cost is independent of dp, tp, cp and ep.

What only `stg validate` of the written set covers: the bytes as written (schema, types,
widths), the group file, and the members' agreement on each group's collective sequence,
which holds here by construction (ranks of a class share one program; groups over variant
axes get sizes every member shares).
"""

from __future__ import annotations

import re
from array import array
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from stg.chakra.load import build_graph
from stg.chakra.rank_graph import Problem, RankGraph
from stg.chakra.replay import Replay
from stg.chakra.validate import unread_problems
from stg.errors import StgError
from stg.program import GroupHole, RankProgram, ReplayNodes, program_replay
from stg.sharding import per_graph

if TYPE_CHECKING:
    from stg.chakra.longest_paths import SlicePaths
    from stg.chakra.repeat_paths import RepeatPaths


class SliceCheckError(StgError):
    """The programs of a pipeline slice hang, or receive data that nothing waits for; writing
    the set would give a simulator a trace that hangs or runs too fast."""


@per_graph(limit=64)  # a slice holds a program per stage
def _chains(program: RankProgram) -> ReplayNodes:
    """The program as the replay reads it: each run of COMP nodes that nothing else touches
    merged into its first. Where COMP nodes form one chain (lowering's single compute stream),
    a COMP node whose only dependency is a COMP node with no other dependent starts the moment
    that one ends, so the run is one node lasting their sum, and every start, finish and wait
    of the replay is unchanged (stg.program.program_replay). A program lowered for timing only
    carries its own."""
    return program.replay if program.replay is not None else program_replay(program.nodes)


def _hole_values(rank: int, program: RankProgram, index_of: dict[int, int], workload) -> dict:
    """What each hole of `rank`'s program stands for: a group's id, a peer's index in the
    slice (`index_of`). Once per rank, not per node (a big program has 10^4-10^5 nodes)."""
    return {hole: workload.group_ids.id(rank, hole) if isinstance(hole, GroupHole)
            else index_of.get(workload.peer(rank, hole)) for hole in program.holes}


def _translated_keys(keys: tuple[tuple, ...], value: dict) -> tuple[tuple, ...]:
    """Comm keys with their holes' values (`value`: _hole_values). Holes looked up by identity:
    the keys share a few hole objects, and a hole's dataclass hash is a Python call."""
    holes = {id(hole): hole for key in keys for hole in key[:1 if len(key) == 3 else 2]}
    at = {ident: value[hole] for ident, hole in holes.items()}
    return tuple((at[id(k[0])], k[1], k[2]) if len(k) == 3 else (at[id(k[0])], at[id(k[1])], k[2], k[3]) for k in keys)


def _graph(index: int, rank: int, program: RankProgram, index_of: dict[int, int], workload) -> RankGraph:
    """Rank `rank`'s program as the replay's compact graph (runs of COMP nodes merged, see
    _chains), ranks renumbered by `index_of`."""
    value = _hole_values(rank, program, index_of, workload)
    chains = _chains(program)
    comm = dict(replace(chains.comm, keys=_translated_keys(chains.comm.keys, value)).items())
    problems: list[Problem] = []
    graph, _ = build_graph(index, chains.ids, chains.types, chains.n_deps, chains.deps, comm, problems)
    assert not problems, problems  # lowering numbers nodes 0..n-1, each depending on earlier ones
    return graph


def slice_paths(workload, ranks: list[int], repeats: bool = True) -> SlicePaths | RepeatPaths:
    """The programs of `ranks` (renumbered 0..len-1) laid out for the longest-path replay; a
    collective's members as rank_graphs has them. Programs lowered for timing from repeats
    alone are read as they are (stg/chakra/repeat_paths.py), their rows never made (unless
    not `repeats`)."""
    from stg.chakra.longest_paths import SlicePaths  # compiled: loaded by the replays that time a plan

    index_of = {rank: i for i, rank in enumerate(ranks)}
    programs = [workload.programs[workload.class_of(rank)] for rank in ranks]
    if repeats and all(program.timed is not None and program.timed.repeats is not None for program in programs):
        from stg.chakra.repeat_paths import RepeatPaths

        return RepeatPaths([program.timed for program in programs],
                           [_hole_values(rank, program, index_of, workload) for rank, program in zip(ranks, programs)],
                           _members(workload, ranks, programs))
    chains = [_chains(program) for program in programs]
    keys = [_translated_keys(c.comm.keys, _hole_values(rank, program, index_of, workload))
            for c, rank, program in zip(chains, ranks, programs)]
    return SlicePaths(chains, keys, _members(workload, ranks, programs))


def replay_durations(program: RankProgram) -> array:
    """The durations of the replay graph's nodes (_graph's), in its order."""
    return array("d", np.asarray(_chains(program).durations, dtype=np.float64).tobytes())


def rank_graphs(workload, ranks: list[int]) -> tuple[list[RankGraph], dict[int, tuple[int, ...]]]:
    """The replay graphs of `ranks` (renumbered 0..len-1) and each group's members among them.
    A collective's members are those of `ranks` in its group; its other members are taken to
    join when this one does (true when they are copies of these ranks, as a slice's are)."""
    index_of = {rank: i for i, rank in enumerate(ranks)}
    programs = [workload.programs[workload.class_of(rank)] for rank in ranks]
    graphs = [_graph(i, rank, program, index_of, workload) for i, (rank, program) in enumerate(zip(ranks, programs))]
    return graphs, _members(workload, ranks, programs)


def _members(workload, ranks: list[int], programs: list[RankProgram]) -> dict[int, tuple[int, ...]]:
    """Each group the programs of `ranks` talk on, with its members' indices in `ranks`."""
    members: dict[int, set[int]] = {}
    for i, (rank, program) in enumerate(zip(ranks, programs)):
        for hole in program.holes:
            if isinstance(hole, GroupHole):
                members.setdefault(workload.group_ids.id(rank, hole), set()).add(i)
    return {g: tuple(sorted(m)) for g, m in members.items()}


def slice_ranks(workload, variant: int = 0) -> list[int]:
    """One rank per pipeline stage, all with the coordinates of the variant's first rank."""
    base, stride = workload.representative(variant), workload.mesh.stride("pp")
    return [base + stage * stride for stage in range(workload.plan.pp)]


def replay_ranks(workload, ranks: list[int]) -> list[Problem]:
    """Replay the programs of `ranks` together (problems name them by their index in `ranks`)."""
    graphs, members = rank_graphs(workload, ranks)
    return unread_problems(graphs) or Replay(graphs, members).run()


def slice_problems(workload) -> list[str]:
    """Problems of each pipeline slice (one per variant), as lines naming stage, rank and node."""
    for variant in range(workload.variants):
        ranks = slice_ranks(workload, variant)
        problems = replay_ranks(workload, ranks)
        if problems:
            programs = [workload.programs[workload.class_of(rank)] for rank in ranks]
            return [_describe(p, ranks, programs) for p in problems]
    return []


def _describe(problem: Problem, ranks: list[int], programs: list[RankProgram]) -> str:
    """A replay problem of slice index i, told as pipeline stage i (rank r), with the node's name."""
    reason = re.sub(r"\branks \[([\d, ]*)\]", lambda m: "stages [" + m.group(1) + "]", problem.reason)
    reason = re.sub(r"\brank (\d+)", lambda m: f"stage {m.group(1)} (rank {ranks[int(m.group(1))]})", reason)
    if problem.rank is None:
        return reason
    where = f"stage {problem.rank} (rank {ranks[problem.rank]})"
    if problem.node is not None:
        where += f", node {problem.node} ({programs[problem.rank].nodes[problem.node].name})"
    return f"{where}: {reason}"


def check_slice(workload) -> None:
    """Raise SliceCheckError (one line) if a pipeline slice hangs or has unread data."""
    lines = slice_problems(workload)
    if lines:
        shown = lines[:4] + ([f"... {len(lines) - 4} more"] if len(lines) > 4 else [])
        raise SliceCheckError("the pipeline slice check failed, nothing written: "
                                 + "; ".join(shown))
