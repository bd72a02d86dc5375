"""Search: enumerate the space, build each plan, drop what does not fit, estimate the rest.

    from stg.explore import explore, Cluster, Job, Space
    result = explore("llama3-8b", Cluster(gpus=64), Job(global_batch=256, seq=8192), Space(zero=(1, 3)))
    result.rows[0].plan, result.rows[0].estimate.step_us, result.dropped

Each plan is built by stg.api.build (the same programs `stg generate` writes) and timed by
stg/explore/cost.py; a faster build drops in there unchanged. Plans are evaluated grouped by
structure (so consecutive plans share the symbolic passes), with `workers` forked processes
each taking whole groups; the result does not depend on the number of workers.
"""

from __future__ import annotations

import time
from collections import Counter
from contextlib import closing
from itertools import groupby
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from model_zoo import Model, load_model
from model_zoo.dlrm import DLRMConfig
from stg.api import MemoryLimitError, build, collector_paused, generate
from stg.device import register_device
from stg.errors import OutputError, PlanError, StgError
from stg.evaluation import structure_order
from stg.explore.cost import Estimate, estimate
from stg.explore.network import Network, load_network
from stg.explore.probe import folded_timings, may_fold, plan_timings, probe_counts
from stg.explore.space import Cluster, Job, Space, plans, reason, recommendation_plans, resolve
from stg.plan import Plan
from stg.workers import forked_map

GIB = 2**30
PLAN_KEYS = ("dp", "tp", "pp", "cp", "ep", "sp", "schedule", "vpp", "zero", "recompute", "micro_batch",
             "embedding_sharding", "local_world_size")


@dataclass(frozen=True)
class Row:
    plan: Plan
    estimate: Estimate

    def to_dict(self) -> dict:
        plan, e = self.plan.to_dict(), self.estimate
        return {**{k: plan[k] for k in PLAN_KEYS},
                "step_ms": e.step_us / 1e3, "tokens_per_s": e.tokens_per_s, "mfu": e.mfu,
                "peak_memory_gib": e.peak_memory / GIB, "bubble": e.bubble,
                "exposed_comm_ms": e.exposed_comm_us / 1e3, "compute_ms": e.compute_us / 1e3,
                **{f"memory_{k}_gib": v / GIB for k, v in e.memory.items() if k != "peak"}}


@dataclass(frozen=True)
class Result:
    rows: tuple[Row, ...]  # fastest first
    dropped: Mapping[str, int]  # reason -> plans
    considered: int
    seconds: float

    def to_dict(self) -> dict:
        # no wall time: the same search prints the same JSON
        return {"considered": self.considered, "valid": len(self.rows), "dropped": dict(self.dropped),
                "rows": [r.to_dict() for r in self.rows]}


def evaluate(model: Model, plan: Plan, network: Network, capacity: int) -> Estimate:
    """A plan's estimate; StgError when it does not build, MemoryLimitError (before lowering)
    when it does not fit `capacity` bytes per rank. Its memory and FLOPs are its own; a long
    pipeline's replay is fitted from folded or shorter ones (stg/explore/probe.py)."""
    with collector_paused():  # as build's: the replays' arrays and dicts make no cycles either
        if probe_counts(plan) is None and not may_fold(plan):  # replayed whole: one build, for timing
            return estimate(build(model, plan, memory_limit=capacity, timing=True), network)
        workload = build(model, plan, memory_limit=capacity, nodes=False)
        return estimate(workload, network,
                        folded_timings(model, workload, network) or plan_timings(model, plan, network))


def _evaluate_chunk(chunk: list[Plan]) -> list[Row | str]:
    """Each plan's Row, or the reason it was dropped (in a worker: the search's inputs are
    _FORKED, set before the fork)."""
    model, network, capacity = _FORKED
    out = []
    for plan in chunk:
        try:
            out.append(Row(plan, evaluate(model, plan, network, capacity)))
        except StgError as error:
            out.append("memory (over the device)" if isinstance(error, MemoryLimitError) else reason(error))
    return out


_FORKED: tuple | None = None  # (model, network, capacity) of the search being run


def _work(plan: Plan) -> int:
    """About what estimating `plan` costs, in replayed stage micro-batches: its replay (the
    probes' of a long pipeline, stg/explore/probe.py; a fold's four short pipelines, about
    4,000), plus about 500 for its build and memory (all that a plan over the device costs)."""
    replayed = 4_000 if may_fold(plan) else plan.pp * plan.vpp * sum(probe_counts(plan) or (plan.microbatches,))
    return 500 + replayed


def _unbatched(plan: Plan) -> dict:
    """A plan's fields but its batch sizes."""
    fields = plan.to_dict()
    fields.pop("micro_batch", None)
    fields.pop("global_batch", None)
    return fields


def _chunks(candidates: list[Plan], workers: int) -> list[list[Plan]]:
    """The plans grouped by structure (a worker then pays each structure's symbolic passes
    once), a group cut where its work passes an eighth of a worker's share, the chunks
    heaviest first: workers handed the longest replays first finish together (longest
    processing time first)."""
    ordered = sorted(candidates, key=structure_order)
    if workers == 1:
        return [[plan] for plan in ordered]
    weighed = [(plan, _work(plan)) for plan in ordered]
    limit = sum(work for _, work in weighed) / (8 * workers)
    chunks: list[tuple[int, list[Plan]]] = []  # (work, plans)
    for _, group in groupby(weighed, key=lambda pair: structure_order(pair[0])[:2]):
        current, total = [], 0
        for plan, work in group:
            # cut only between plans that differ in more than their batch sizes: a tied
            # model's stage cut and a folded plan's probes (stg/explore/probe.py) have passes
            # of their own, which a worker would pay again
            if current and total + work > limit and _unbatched(plan) != _unbatched(current[-1]):
                chunks.append((total, current))
                current, total = [], 0
            current.append(plan)
            total += work
        chunks.append((total, current))
    return [plans for _, plans in sorted(chunks, key=lambda chunk: -chunk[0])]


def explore(model: Model | str, cluster: Cluster, job: Job, space: Space = Space(), *,
            headroom: float = 0.0, progress: Callable[[int, int], None] | None = None,
            workers: int = 1) -> Result:
    """Every valid plan of `space`, fastest first; `headroom`: the fraction of device memory
    kept free; `workers`: processes evaluating plans (forked; the result is the same)."""
    global _FORKED
    if not 0 <= headroom < 1:
        raise PlanError(f"headroom: must be a fraction in [0, 1), got {headroom!r}")
    started = time.perf_counter()
    model = model if isinstance(model, Model) else load_model(model)
    device = register_device(cluster.device)
    cluster = Cluster(cluster.gpus, device.name, cluster.network, cluster.gpus_per_node)
    network = load_network(cluster.network)
    capacity = int(device.memory_gib * GIB * (1 - headroom))
    dropped: Counter = Counter()
    if isinstance(model.config, DLRMConfig):
        micro_batch = None if space.micro_batch == Space().micro_batch else space.micro_batch
        candidates = list(recommendation_plans(space, cluster, job, dropped, micro_batch))
    else:
        resolved = resolve(space, cluster, model.layers, getattr(model.config, "experts", None))
        candidates = list(plans(resolved, cluster, job, dropped, model.layers))
    considered = len(candidates) + sum(dropped.values())  # and those Plan refused
    if workers < 1:
        raise PlanError(f"workers: must be a positive integer, got {workers}")
    rows, done = [], 0
    _FORKED = (model, network, capacity)
    try:
        chunks = _chunks(candidates, workers)
        # a plan's build and replay leave no reference cycles (a full collection after one
        # finds none), so the collector stays paused for the whole search, workers too (forked
        # paused): its young collections after each plan rescanned everything the plan had
        # cached (6 % of the 1T space's time)
        with collector_paused(), closing(forked_map(_evaluate_chunk, chunks, workers)) as evaluated:
            for _, results in evaluated:
                for row in results:
                    if isinstance(row, Row):
                        rows.append(row)
                    else:
                        dropped[row] += 1
                done += len(results)
                if progress:
                    progress(done, len(candidates))
    finally:
        _FORKED = None
    rows.sort(key=lambda r: (r.estimate.step_us, r.estimate.peak_memory, [str(r.plan.to_dict()[k]) for k in PLAN_KEYS]))
    return Result(tuple(rows), dict(sorted(dropped.items())), considered,
                  time.perf_counter() - started)


def label(plan: Plan) -> str:
    """A folder name that says the plan: dp8-tp4-pp2-1f1b-z1-rnone-mb1 (a recommendation
    model's: dp2-local8-table_row_wise-mb256)."""
    if plan.embedding_sharding:
        local = f"-local{plan.local_world_size}" if plan.local_world_size > 1 else ""
        return f"dp{plan.dp}{local}-{plan.embedding_sharding}-mb{plan.micro_batch}"
    parts = [f"dp{plan.dp}", f"tp{plan.tp}" + ("sp" if plan.sp else ""), f"pp{plan.pp}"]
    parts += [f"cp{plan.cp}"] * (plan.cp > 1) + [f"ep{plan.ep}"] * (plan.ep > 1)
    parts += [plan.schedule + (f"{plan.vpp}" if plan.vpp > 1 else ""), f"z{plan.zero}",
              f"r{plan.recompute.value}", f"mb{plan.micro_batch}"]
    return "-".join(parts)


def write_top(model: Model | str, result: Result, top: int, out: Path) -> list[Path]:
    """The trace sets of the `top` fastest plans, each in OUT/<rank>-<label>/ with its plan.yaml."""
    written = []
    for i, row in enumerate(result.rows[:top], 1):
        folder = out / f"{i:02d}-{label(row.plan)}"
        generate(model, row.plan, folder)
        try:
            (folder / "plan.yaml").write_text(yaml.safe_dump(row.plan.to_dict(), sort_keys=False))
        except OSError as error:
            raise OutputError(f"write: cannot write {folder}: {error.strerror}") from None
        written.append(folder)
    return written
