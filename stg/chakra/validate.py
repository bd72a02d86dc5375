"""Check a directory of per-rank Chakra traces against what ASTRA-sim needs to run them.

The directory holds ``workload.<rank>.et`` for ranks 0..N-1 and ``workload.json`` (the
communicator groups). Checks, in the terms of shared/reference/chakra-astrasim.md:

a. layout and workload.json (D.1, D.7)      d. per-group collective sequences (D.6, B.4)
b. per-rank graph structure (D.2, D.3)       e. send/recv matching (D.8)
c. attribute types and values (D.4-D.8)      f. a zero-time replay of all ranks under the issue
g. RECVs and collectives nobody waits for       rules of B.4/B.5, which finds cross-rank deadlocks
Each rank file is read once into compact arrays (the pb2 nodes are not kept), by worker
processes when the set is large (stg/chakra/load.py, which also makes checks a-c). The replay is logical, not timed: it proves that the issue
order ASTRA-sim follows (lowest ready id first, one collective or send in flight per rank)
cannot wedge, not how long a step takes; ``timed_replay`` runs the same rules with time.
"""

from __future__ import annotations

from array import array
from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from stg.chakra.load import Progress, _load_groups, _load_ranks, _rank_files
from stg.chakra.rank_graph import (ALL_RANKS, COLL, COMP, RECV, SEND, CommKey, Problem, RankGraph, coll_name,
                                   group_label, p2p_text)
from stg.chakra.replay import CommCost, CommModel, Replay, ReplayError, TimedReplay, Timing

# --- d./e. cross-rank matching --------------------------------------------------------------


def _check_collectives(graphs: list[RankGraph], groups: dict[int, tuple[int, ...]] | None) -> list[Problem]:
    # per group and rank, its collectives' keys (group, type, size) in issue order, and their
    # nodes' indices: a member's keys are compared with the first member's as lists (a million
    # collectives on a thousand ranks), and node by node only when they differ
    seqs: dict[int, dict[int, tuple[RankGraph, list[int], list[CommKey]]]] = defaultdict(dict)
    for g in graphs:
        types, comm, mine = g.types, g.comm, {}
        for i in sorted(comm):
            if types[i] == COLL:
                key = comm[i]
                found = mine.get(key[0])
                if found is None:
                    found = mine[key[0]] = seqs[key[0]][g.rank] = (g, [], [])
                found[1].append(i)
                found[2].append(key)
    loaded = {g.rank for g in graphs}
    problems = []
    for group, by_rank in sorted(seqs.items()):
        declared = groups.get(group) if groups else None
        members = [m for m in (declared or sorted(by_rank)) if m in loaded]
        if group == ALL_RANKS and not declared:
            members = sorted(loaded)
        if not members:
            continue
        ref = members[0]
        ref_keys = by_rank[ref][2] if ref in by_rank else []
        for m in members[1:]:
            if (by_rank[m][2] if m in by_rank else []) == ref_keys:
                continue
            problem = _compare_sequences(group, ref, _sequence(by_rank.get(ref)), m, _sequence(by_rank.get(m)))
            if problem is not None:
                problems.append(problem)
    return problems


def _sequence(found: tuple[RankGraph, list[int], list[CommKey]] | None) -> list[tuple[int, int, int]]:
    """A rank's collectives on a group as (node id, type, size), in issue order."""
    if found is None:
        return []
    g, places, keys = found
    return [(g.ids[i], ctype, size) for i, (_, ctype, size) in zip(places, keys)]


def _compare_sequences(group: int, ref: int, ref_seq: list[tuple[int, int, int]], m: int,
                       seq: list[tuple[int, int, int]]) -> Problem | None:
    label = group_label(group)
    for k, ((nid, ctype, size), (_, rtype, rsize)) in enumerate(zip(seq, ref_seq), start=1):
        if (ctype, size) != (rtype, rsize):
            return Problem(m, nid, f"collective #{k} on {label} is {coll_name(ctype)} of {size} B but "
                                   f"rank {ref} issues {coll_name(rtype)} of {rsize} B")
    if len(seq) < len(ref_seq):
        nid, rtype, rsize = ref_seq[len(seq)]
        return Problem(m, None, f"issues {len(seq)} collectives on {label} but rank {ref} issues "
                                f"{len(ref_seq)}; first missing is #{len(seq) + 1}, {coll_name(rtype)} "
                                f"of {rsize} B (rank {ref} node {nid})")
    if len(seq) > len(ref_seq):
        nid, ctype, size = seq[len(ref_seq)]
        return Problem(m, nid, f"collective #{len(ref_seq) + 1} on {label} ({coll_name(ctype)} of "
                               f"{size} B) has no counterpart: rank {ref} issues only {len(ref_seq)}")
    return None


def _check_point_to_point(graphs: list[RankGraph]) -> list[Problem]:
    sends: dict[CommKey, list[tuple[int, int]]] = defaultdict(list)
    recvs: dict[CommKey, list[tuple[int, int]]] = defaultdict(list)
    for g in graphs:
        for i in sorted(g.comm):
            if g.types[i] in (SEND, RECV):
                (sends if g.types[i] == SEND else recvs)[g.comm[i]].append((g.rank, g.ids[i]))
    # Matching is a multiset one; the surplus of a key is its latest nodes.
    extra_sends = {k: v[len(recvs.get(k, ())):] for k, v in sends.items() if len(v) > len(recvs.get(k, ()))}
    extra_recvs = {k: v[len(sends.get(k, ())):] for k, v in recvs.items() if len(v) > len(sends.get(k, ()))}
    near: dict[tuple[int, int], list[CommKey]] = defaultdict(list)
    for key in extra_sends:
        near[key[:2]].append(key)
    problems = []
    for key, nodes in sorted(extra_recvs.items()):
        hint = ""
        if near.get(key[:2]):
            other = min(near[key[:2]], key=lambda k: (k[2] != key[2], k))
            hint = f" (rank {key[0]} has an unmatched SEND to rank {key[1]} with tag {other[2]}, {other[3]} B)"
        problems.extend(Problem(r, nid, f"{p2p_text(RECV, key)} has no matching SEND{hint}") for r, nid in nodes)
    for key, nodes in sorted(extra_sends.items()):
        problems.extend(Problem(r, nid, f"{p2p_text(SEND, key)} has no matching RECV") for r, nid in nodes)
    return problems


# --- g. data nobody waits for ---------------------------------------------------------------


def unread_problems(graphs: list[RankGraph]) -> list[Problem]:
    """A RECV or collective that no node depends on: compute that does not wait for the data
    it needs simulates too fast, silently. Allowed: collectives after the rank's last COMP
    node (the step's parameter all-gathers for the next step may end a program)."""
    problems = []
    for g in graphs:
        last_comp = g.types.rfind(COMP)
        for i in sorted(g.comm):
            if g.child_start[i + 1] > g.child_start[i]:
                continue
            if g.types[i] == RECV:
                problems.append(Problem(g.rank, g.ids[i], f"{p2p_text(RECV, g.comm[i])}: no node depends on "
                                                          f"it, so nothing waits for the data it brings"))
            elif g.types[i] == COLL and i < last_comp:
                group, ctype, size = g.comm[i]
                problems.append(Problem(g.rank, g.ids[i], f"{coll_name(ctype)} of {size} B on "
                                                          f"{group_label(group)}: no node depends on it, though "
                                                          f"compute follows (node {g.ids[last_comp]})"))
    return problems


# --- entry points ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadedSet:
    graphs: list[RankGraph]
    groups: dict[int, tuple[int, ...]] | None
    durations: list[array | None]  # by rank, when asked for
    problems: list[Problem]
    structural: bool  # problems in the files themselves (not only in cross-rank matching)

    @cached_property
    def compiled(self):
        """The set laid out once for both compiled loops (stg/chakra/replay_kernel.py: the
        zero-time run and, with durations, the timed one); None below COMPILED_FROM_NODES
        nodes, where the Python replays are done before numba's import and cached loops
        would load (~0.5 s; they replay about 400,000 nodes a second here)."""
        if sum(len(g.ids) for g in self.graphs) < COMPILED_FROM_NODES:
            return None
        from stg.chakra.replay_kernel import CompiledReplay  # numba: imported where it pays

        durations = self.durations if all(d is not None for d in self.durations) else []
        return CompiledReplay(self.graphs, self.groups, durations)


COMPILED_FROM_NODES = 200_000


def _load_and_check(out: Path, progress: Progress | None, durations: bool) -> LoadedSet:
    """Checks a to e over one pass through the files."""
    problems: list[Problem] = []
    n_ranks, paths = _rank_files(out, problems)
    groups = _load_groups(out, n_ranks, problems)
    graphs, rank_problems, per_node = _load_ranks(paths, n_ranks, groups, progress, durations)
    problems.extend(rank_problems)
    structural = bool(problems)
    problems.extend(_check_collectives(graphs, groups))
    problems.extend(_check_point_to_point(graphs))
    if not structural:
        problems.extend(unread_problems(graphs))
    return LoadedSet(graphs, groups, per_node, problems, structural)


def load_set(out_dir: str | Path, *, progress: Progress | None = None, durations: bool = False) -> LoadedSet:
    """``out_dir`` read once, with checks a-e: what ``validate`` and ``timed_replay`` (which
    needs ``durations``) work on, so that `stg validate --timed` reads a set once."""
    return _load_and_check(Path(out_dir), progress, durations)


def validate(out_dir: str | Path, *, replay: bool = True, progress: Progress | None = None,
             loaded: LoadedSet | None = None) -> list[Problem]:
    """All problems found in ``out_dir`` (an empty list means ASTRA-sim can run it to the end);
    ``loaded``: the set as load_set read it."""
    loaded = loaded or load_set(out_dir, progress=progress)
    problems = list(loaded.problems)
    if replay and not loaded.structural and loaded.groups is not None and not _completes(loaded):
        problems.extend(Replay(loaded.graphs, loaded.groups).run())
    return problems


def _completes(loaded: LoadedSet) -> bool:
    """True when the compiled zero-time run (a big set: LoadedSet.compiled) shows that Replay
    would find no deadlock; False otherwise, Replay then runs and says why."""
    return loaded.compiled is not None and loaded.compiled.completes()


def timed_replay(out_dir: str | Path, *, comm: CommModel | str = CommModel.FREE, alpha_us: float = 5.0,
                 bandwidth_gbps: float = 50.0, progress: Progress | None = None,
                 record: Collection[int] = (), network=None, loaded: LoadedSet | None = None) -> Timing:
    """Makespan and per-rank busy/idle time of ``out_dir`` replayed with time (see TimedReplay).

    COMP nodes take their ``duration_micros``. ``comm="free"``: collectives end when their last
    member joins, sends take no time. ``comm="alpha-beta"``: a collective takes ``alpha_us`` + ring
    factor x comm_size / bandwidth after its last member joined (ALL_REDUCE 2(n-1)/n,
    REDUCE_SCATTER and ALL_TO_ALL (n-1)/n, ALL_GATHER n-1 of its per-rank shard), a SEND
    ``alpha_us`` + comm_size / bandwidth. The defaults (5 µs, 50 GB/s) are illustrative, not a
    network model. Raises ReplayError when the set has any problem ``validate`` would report
    (checks a-e), or when the timed replay deadlocks; ValueError on bad options. Issue order
    depends on time, so this can find a deadlock that validate's zero-time replay misses (a
    collective that takes the comm slot while a lower-id SEND still waits on a COMP).
    ``record``: ranks whose per-node start and end times come back in ``Timing.nodes``.
    ``network`` (a stg.explore.network.Network): with alpha-beta, communication costs come from
    its tiers and NCCL's algorithms instead of the flat constants, as `stg explore` charges them.
    ``loaded``: the set as load_set read it, with durations. Without ``record``, a big set
    (LoadedSet.compiled) runs the compiled event loop (the same rules, the same floats), and
    TimedReplay only for a deadlock's report.
    """
    if isinstance(comm, str):
        try:
            comm = CommModel(comm)
        except ValueError:
            raise ValueError(f"comm must be one of {[m.value for m in CommModel]}, got {comm!r}") from None
    cost = CommCost(comm, alpha_us, bandwidth_gbps)
    loaded = loaded or load_set(out_dir, progress=progress, durations=True)
    assert all(d is not None for d in loaded.durations), "load_set(..., durations=True)"
    if loaded.problems:
        n = len(loaded.problems)
        raise ReplayError(f"{out_dir} has {n} problem{'s' * (n != 1)}; fix them before a timed replay",
                          loaded.problems)
    assert loaded.groups is not None  # a missing or broken workload.json is a problem above
    bad = sorted(r for r in record if not 0 <= r < len(loaded.graphs))
    if bad:
        raise ValueError(f"record: ranks {bad} are not in 0..{len(loaded.graphs) - 1}")
    if network is not None and comm is CommModel.ALPHA_BETA:
        cost = network.bind(loaded.groups, world=len(loaded.graphs))
    if not record and loaded.compiled is not None:
        timing = loaded.compiled.run(cost)
        if timing is not None:
            return timing
    return TimedReplay(loaded.graphs, loaded.groups, loaded.durations, cost, record).run()
