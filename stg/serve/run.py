"""The serving modes, from a model and a ServePlan to a written trace set.

  prefill  one step: `batch` prompts of `prompt` tokens, each sampling its first token
  decode   `steps` steps of `batch` requests, the context growing by one a step from `context`
  serve    a request trace through the continuous-batching scheduler (stg/serve/scheduler.py)

Every rank's trace is its iterations one after another: iteration i + 1's first compute
follows iteration i's last compute, its first communication the last one of iteration i, and
send/recv tags are unique per iteration. With pp > 1 the last stage sends the sampled tokens
back to the first (a decode's input is the token its previous iteration sampled); in serve
mode pp virtual engines keep pp steps in flight, step k waiting on the first stage for step
k - pp's tokens (stg/serve/engine.py's lag), otherwise each step waits for the previous one's.

Time (serve mode): each replica has a clock; before each iteration the requests that have
arrived by then join its queue. An iteration takes on each pipeline stage what the cost
model says: the sum of its compute nodes' durations (the device roofline, max(FLOPs / peak,
bytes / bandwidth), the durations written in the trace) plus its collectives and sends under
the alpha-beta network of `stg validate --timed alpha-beta` (ring factors, 5 us, 50 GB/s);
a stage takes it once the stage before has passed it on and the stage is free (run_replica).
A request's token is out when its iteration leaves the last stage.
"""

from __future__ import annotations

import math
import shutil
from collections import deque
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from model_zoo import Model, load_model
from stg import __version__
from stg.chakra.replay import CommCost, CommModel
from stg.emit import commit_output, prepare_output, write_groups
from stg.errors import OutputError, PlanError
from stg.plan import Plan
from stg.program import NodeType, RankProgram
from stg.serve.engine import Engine, ServePlan
from stg.serve.metrics import request_metrics, totals
from stg.serve.records import FILE as ITERATIONS_FILE, dump_summary, write_iterations
from stg.serve.kvcache import KVPlan, kv_bytes_per_token_per_layer, plan_kv_cache
from stg.serve.scheduler import Iteration, Request, Scheduler, SchedulerConfig, Slot
from stg.serve.step import StepShape, uniform
from stg.serve.stream import StageWriter, links, stage_stats, write_class
from stg.slice_check import check_slice

TAG_LIMIT = 400_000_000  # below ASTRA-sim's comm_tag limit


class Mode(Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    SERVE = "serve"


def chain(programs: Sequence[RankProgram], edges: int) -> RankProgram:
    """Steps of one stage in order as one program, linked as the written set links them
    (stg/serve/stream.py: to the previous step's last compute and last message); for the slice check."""
    nodes, last = [], {"compute": None, "comm": None}
    for index, program in enumerate(programs):
        base, previous, n = len(nodes), links(program.nodes), len(program.nodes)
        own_last = max((i for i, x in enumerate(program.nodes) if x.type is NodeType.COMP_NODE), default=None)
        for i, node in enumerate(program.nodes):
            deps = {d + base for d in node.deps}
            for offset in previous[i] if index else ():
                target = last["compute"] if offset + n == own_last else (last["comm"] if last["comm"] is not None
                                                                          else last["compute"])
                deps.add(target)
            message = node.type in (NodeType.COMM_SEND_NODE, NodeType.COMM_RECV_NODE)
            nodes.append(replace(node, id=len(nodes), deps=tuple(sorted(deps)),
                                 tag=node.tag + index * edges if message else 0))
        for node in nodes[base:]:
            last["compute" if node.type is NodeType.COMP_NODE else "comm"] = node.id
    return RankProgram(programs[0].key, tuple(nodes), programs[0].stats)


class Clock:
    """Iteration durations under the cost model (module docstring), per step shape."""

    def __init__(self, engine: Engine, comm: CommCost = CommCost(CommModel.ALPHA_BETA), draft: Engine | None = None):
        self.engine, self.comm = engine, comm
        self.draft = Clock(draft, comm) if draft is not None else None
        self.sizes = engine.plan.parallel().mesh().sizes
        self.cache: dict[StepShape, float] = {}
        self.stages: dict[tuple[int, StepShape], float] = {}

    def stage_us(self, stage: int, shape: StepShape) -> float:
        key = (stage, shape)
        if key not in self.stages:
            if len(self.stages) > 100_000:
                self.stages.clear()
            self.stages[key] = self._stage_us(stage, shape)
        return self.stages[key]

    def _stage_us(self, stage: int, shape: StepShape) -> float:
        template = self.engine.template(stage)
        values = template.values(shape, self.engine.device)
        total = float(values["exact_us"].sum())  # unrounded: the trace's durations are whole microseconds
        for index, size in zip(template.comm, values["comm_bytes"]):
            node = template.program.nodes[index]
            if node.type is NodeType.COMM_COLL_NODE:
                members = math.prod(self.sizes[a] for a in node.group.axes)
                total += self.comm.collective_us(node.collective.value, int(size), members)
            elif node.type is NodeType.COMM_SEND_NODE:
                total += self.comm.send_us(int(size))
        return total

    def step_us(self, shape: StepShape) -> float:
        if shape not in self.cache:
            if len(self.cache) > 100_000:
                self.cache.clear()
            self.cache[shape] = sum(self.stage_us(s, shape) for s in range(self.engine.plan.pp))
        return self.cache[shape]


@dataclass(frozen=True)
class Timed:
    engines: tuple[Iteration, ...]  # per engine stepping together (expert parallelism: ep of them)
    shape: StepShape  # what each engine runs (the widest engine's step)
    start_s: float
    end_s: float
    draft: tuple[StepShape, ...] = ()  # speculative decoding: the draft model's steps before the target's
    group: int | None = None  # pp virtual engine (when several steps are in flight)

    @property
    def iteration(self) -> Iteration:
        return self.engines[0]

    @property
    def slots(self) -> tuple[Slot, ...]:
        return tuple(slot for iteration in self.engines for slot in iteration.slots)

    def to_dict(self) -> dict:
        extra = {"draft_steps": len(self.draft)} if self.draft else {}
        if self.group is not None:
            extra["virtual_engine"] = self.group
        composition = (self.iteration.to_dict() if len(self.engines) == 1 else
                       {"iteration": self.iteration.index, "engines": [it.to_dict() for it in self.engines]})
        return {**composition, **self.shape.to_dict(), **extra, "start_s": self.start_s, "end_s": self.end_s}


def draft_steps(slots: tuple[Slot, ...], proposals: int, attention) -> tuple[StepShape, ...]:
    """The draft model's steps in an iteration: the first runs the prompt chunks (its own cache
    follows the target's) and each decode's last token; then one step per further proposal,
    the decodes only, each one token on a context grown by one."""
    if not proposals:
        return ()
    decodes = [s for s in slots if s.decode]
    first = tuple(Slot(s.request, 1, s.c, True) if s.decode else replace(s, samples=False) for s in slots)
    later = [tuple(Slot(s.request, 1, s.c + j, True) for s in decodes) for j in range(1, proposals)] if decodes else []
    return tuple(StepShape.of(step, attention) for step in (first, *later))


def scheduler_config(plan: ServePlan, kv: KVPlan) -> SchedulerConfig:
    return SchedulerConfig(plan.scheduler, plan.max_num_batched_tokens, plan.max_num_seqs, plan.block_size, kv.blocks,
                           speculative=plan.speculative, acceptance_rate=plan.acceptance_rate)


def run_replica(requests: Sequence[Request], config: SchedulerConfig, clock: Clock, attention,
                engines: int = 1, lag: int = 1) -> list[Timed]:
    """Schedule one replica's requests in time.

    With `engines` > 1 (expert parallelism) a step's requests come from that many schedulers
    that step together (an idle one runs an empty step), every engine running the widest
    engine's step. With `lag` > 1 (pp virtual engines, vLLM's) the replica has `lag` such
    groups, requests dealt to them round-robin, and step k belongs to group k mod lag: it enters
    the first stage once that stage is free and step k - lag's tokens are back (an idle group's
    turn is an empty step), and each stage takes it once the stage before has passed it on.
    With lag 1 an iteration thus passes the stages one after another."""
    groups = [[deque(requests[v::lag][e::engines]) for e in range(engines)] for v in range(lag)]
    schedulers = [[Scheduler(config) for _ in range(engines)] for _ in range(lag)]
    stages = clock.engine.plan.pp
    free, back, timed, floor = [0.0] * stages, [], [], 0.0  # back[k]: when step k's tokens are on stage 0
    while any(q for group in groups for q in group) or not all(s.idle for g in schedulers for s in g):
        k = len(timed)
        start = max(free[0], back[k - lag] if k >= lag else 0.0, floor)
        for group, scheds in zip(groups, schedulers):
            for queue, scheduler in zip(group, scheds):
                arrived = []
                while queue and queue[0].arrival_s <= start:
                    arrived.append(queue.popleft())
                scheduler.arrive(arrived)
        if all(s.idle for g in schedulers for s in g):
            floor = min(q[0].arrival_s for group in groups for q in group if q)
            continue
        iterations = tuple(s.step() or Iteration(s.iterations, (), 0) for s in schedulers[k % lag])
        shape = StepShape.widest(StepShape.of(it.slots, attention) for it in iterations)
        # each ep engine drafts for its own requests; all run the widest engine's draft steps
        drafts = [draft_steps(it.slots, config.speculative, attention) for it in iterations]
        draft = tuple(StepShape.widest(d[j] for d in drafts if j < len(d)) for j in range(max(map(len, drafts))))
        at = start + sum(clock.draft.stage_us(0, d) for d in draft) / 1e6 if draft else start
        for stage in range(stages):
            at = max(at, free[stage]) + clock.stage_us(stage, shape) / 1e6
            free[stage] = at
        back.append(at)
        timed.append(Timed(iterations, shape, start, at, draft, k % lag if lag > 1 else None))
    return timed


def idle_replicas(runs: list[list[Timed]], field: str, count: int) -> None:
    """A replica without a single iteration would be an empty trace file (ASTRA-sim aborts on one)."""
    idle = [index for index, timed in enumerate(runs) if not timed]
    if idle:
        raise PlanError(f"{field}: {count} leaves {len(idle)} of them without a request to run (e.g. number "
                        f"{idle[0]}); use fewer")


def generate_serving(model: Model | str | Path | Mapping, plan: ServePlan | Mapping, out: str | Path, *,
                     mode: Mode | str, batch: int = 1, prompt: int = 1024, context: int = 1024, steps: int = 1,
                     requests: Sequence[Request] | str | Path | None = None, slo_ttft_ms: float | None = None,
                     slo_tpot_ms: float | None = None) -> dict:
    """Write the trace set of a serving run to OUT and return its summary (summary.json)."""
    model = model if isinstance(model, Model) else load_model(model)
    plan = plan if isinstance(plan, ServePlan) else ServePlan(**plan)
    try:
        mode = Mode(mode)
    except ValueError:
        raise PlanError(f"mode: must be one of {[m.value for m in Mode]}, got {mode!r}") from None
    for name, value in (("batch", batch), ("prompt", prompt), ("context", context), ("steps", steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise PlanError(f"{name}: must be a positive integer, got {value!r}")
    _check_positions(model, mode, prompt, context + steps, requests)
    if plan.prefill_instances:
        if mode is not Mode.SERVE:
            raise PlanError("prefill_instances: disaggregated serving runs a request trace (mode serve)")
        return _disaggregated(model, plan, out, requests, slo_ttft_ms, slo_tpot_ms)
    # pp virtual engines keep pp steps in flight in serve mode (decode and prefill modes run one batch)
    engine = Engine(model, plan, lag=plan.pp if mode is Mode.SERVE else 1)
    # the draft: on the first stage's ranks (pp 1), a whole copy per ep engine (ep 1), the plan's tp
    draft = Engine(load_model(plan.draft), replace(plan, speculative=0, draft=None, pp=1, ep=1)) \
        if plan.speculative else None
    kv = plan_kv_cache(engine, draft)
    clock = Clock(engine, draft=draft)
    if mode is Mode.SERVE:
        if requests is None:
            raise PlanError("requests: serve mode needs a request trace (--requests FILE)")
        if not isinstance(requests, (list, tuple)):
            from stg.serve.requests import load_requests

            requests = load_requests(requests)
        config = scheduler_config(plan, kv)
        shares = [list(requests[r::plan.dp]) for r in range(plan.dp)]  # round-robin in arrival order
        replicas = [run_replica(share, config, clock, plan.attention_flops, plan.ep, engine.lag) for share in shares]
        idle_replicas(replicas, "dp", plan.dp)
    else:
        if requests is not None:
            raise PlanError(f"requests: a request trace runs in mode serve, not {mode.value}")
        if batch % plan.ep:
            raise PlanError(f"batch: {batch} requests do not split evenly over ep={plan.ep} engines")
        tokens = prompt if mode is Mode.PREFILL else context + steps
        per_engine = batch // plan.ep
        need = per_engine * -(-tokens // plan.block_size)
        if need > kv.blocks:
            raise PlanError(f"batch: {batch} requests of {tokens} tokens need {need} KV blocks; the cache has "
                            f"{kv.blocks} (num_kv_blocks)")
        if plan.speculative:
            raise PlanError("speculative: applies to serve mode (a request trace)")
        replicas = [UniformSteps(clock, plan, per_engine, need, prompt if mode is Mode.PREFILL else 1,
                                 0 if mode is Mode.PREFILL else context, 1 if mode is Mode.PREFILL else steps)]
    summary = _summary(model, plan, mode, engine, kv, replicas, requests, slo_ttft_ms, slo_tpot_ms)
    _write(Path(out), model, plan, engine, replicas, summary, draft)
    return summary


class UniformSteps(Sequence):
    """The steps of prefill and decode modes, built when asked for (10,000 decode steps held as
    Timed objects grew the memory): step i runs `batch` requests per engine of q new tokens on
    c + i cached ones; only the end times are kept (one float a step)."""

    def __init__(self, clock: Clock, plan: ServePlan, batch: int, blocks: int, q: int, c: int, steps: int):
        self.plan, self.batch, self.blocks, self.q, self.c = plan, batch, blocks, q, c
        ends, now = [], 0.0
        for index in range(steps):  # the clock's cache keeps a shape's time, not the shape's slots
            now += clock.step_us(self._shape(index)) / 1e6
            ends.append(now)
        self.ends = np.array(ends)

    def _engines(self, index: int) -> tuple[Iteration, ...]:
        return tuple(Iteration(index, uniform(self.batch, self.q, self.c + index, first=e * self.batch), self.blocks)
                     for e in range(self.plan.ep))

    def _shape(self, index: int) -> StepShape:
        return StepShape.of(uniform(self.batch, self.q, self.c + index), self.plan.attention_flops)

    def __len__(self) -> int:
        return len(self.ends)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        index = index + len(self) if index < 0 else index
        if not 0 <= index < len(self):
            raise IndexError(index)
        start = float(self.ends[index - 1]) if index else 0.0
        return Timed(self._engines(index), self._shape(index), start, float(self.ends[index]))


def _disaggregated(model: Model, plan: ServePlan, out, requests, slo_ttft_ms, slo_tpot_ms) -> dict:
    """Prefill and decode instances (stg/serve/disagg.py), each kind with its engine and KV pool."""
    from stg.serve.disagg import Side, check_layouts, run_disaggregated

    if requests is None:
        raise PlanError("requests: serve mode needs a request trace (--requests FILE)")
    if not isinstance(requests, (list, tuple)):
        from stg.serve.requests import load_requests

        requests = load_requests(requests)
    check_layouts(model, plan)
    sides = {}
    for kind in ("prefill", "decode"):
        own = plan.instance_plan(kind)
        same = kind == "decode" and (own.tp, own.pp) == (sides["prefill"].engine.plan.tp, sides["prefill"].engine.plan.pp)
        engine = sides["prefill"].engine if same else Engine(model, own)
        kv = sides["prefill"].kv if same else plan_kv_cache(engine)
        sides[kind] = Side(engine, sides["prefill"].clock if same else Clock(engine), scheduler_config(own, kv), kv)
    summary = _header(model, plan, Mode.SERVE, sides["decode"].kv)
    summary["kv_cache_prefill"] = _header(model, plan, Mode.SERVE, sides["prefill"].kv)["kv_cache"]
    summary.pop("mesh")  # each instance's layout: summary["instances"]
    return run_disaggregated(model, plan, sides["prefill"], sides["decode"], list(requests), Path(out), summary,
                             _s(slo_ttft_ms), _s(slo_tpot_ms))


def _check_positions(model: Model, mode: Mode, prompt: int, decoded: int, requests) -> None:
    """A model with learned positions holds at most max_positions tokens per sequence."""
    limit = getattr(model.config, "max_positions", None)
    if getattr(model.config, "positions", None) != "learned" or limit is None:
        return
    if mode is Mode.SERVE and requests is not None and not isinstance(requests, (list, tuple)):
        from stg.serve.requests import load_requests

        requests = load_requests(requests)
    longest = {Mode.PREFILL: ("prompt", prompt), Mode.DECODE: ("context + steps", decoded)}.get(mode)
    if mode is Mode.SERVE and requests:
        r = max(requests, key=lambda r: r.prompt + r.output)
        longest = (f"request {r.id}: prompt + output", r.prompt + r.output)
    if longest and longest[1] > limit:
        raise PlanError(f"{longest[0]} = {longest[1]} exceeds model {model.name}'s max_positions={limit} "
                        "(learned positions)")


def _workload(model: Model, plan: ServePlan, engine: Engine, shared: bool, repeat: int = 1):
    """The set's ranks and classes (stg.api.Workload) with each class's program the stage's
    template repeated `repeat` times; classes are (stage, replica) unless every replica runs
    the same iterations."""
    from stg.api import Workload

    parallel = Plan(tp=plan.tp, pp=plan.pp, ep=plan.ep, dp=plan.dp * plan.ep, etp=plan.tp, sp=False, device=plan.device,
                    schedule="gpipe")
    variants = 1 if shared else plan.dp
    programs = [chain([t.program for t, _ in engine.sequence(stage, repeat)], engine.edges)
                for stage in range(plan.pp) for _ in range(variants)]
    axes, index = ((), ()) if shared else (("dp",), tuple(range(plan.dp)))
    return Workload(model, parallel, parallel.mesh(), engine.sharded, tuple(programs), (), {}, axes, index)


def _write(out: Path, model: Model, plan: ServePlan, engine: Engine, replicas: list[list[Timed]], summary: dict,
           draft: Engine | None = None):
    """Check a two-iteration slice for deadlocks (every iteration has the same structure and
    iterations only follow each other), then stream every class's iterations to its ranks."""
    iterations = max(len(r) for r in replicas)
    if iterations * max(engine.edges, 1) >= TAG_LIMIT:
        raise PlanError(f"iterations: {iterations} are too many for unique send/recv tags below {TAG_LIMIT:,}")
    shared = len(replicas) == 1
    check_slice(_workload(model, plan, engine, shared, repeat=2 * engine.lag))
    workload = _workload(model, plan, engine, shared)
    world = workload.mesh.size
    members: dict[int, list[int]] = {}
    for rank in range(world):
        members.setdefault(workload.class_of(rank), []).append(rank)
    per_iteration = max(len(engine.template(s).program.nodes) for s in range(plan.pp)) + (
        plan.speculative * len(draft.template(0).program.nodes) if draft is not None else 0)
    id_width = max(1, ((max(len(r) for r in replicas) + 1) * per_iteration + engine.lag).bit_length() // 7 + 1)
    folder = prepare_output(out)
    try:
        write_groups(folder / "workload.json", workload.group_ids)
        classes = []
        for cls, program in enumerate(workload.programs):
            stage, replica = divmod(cls, workload.variants)
            sequence = engine.sequence(stage, len(replicas[replica]))
            small = draft.template(0) if draft is not None else None
            kinds = {id(t): t for t, _ in sequence}
            holes = sorted({h for t in kinds.values() for h in t.program.holes}
                           | set(small.program.holes if small else ()), key=str)
            widths = {h: len(v) for h, v in workload.hole_values(members[cls][0], holes).items()}
            writers = {key: StageWriter(t, engine.edges, id_width, widths) for key, t in kinds.items()}
            proposer = StageWriter(small, 0, id_width, widths, counts=False) if small else None
            stats: dict = {}

            def steps():
                timed = iter(replicas[replica])
                for template, is_step in sequence:
                    shape = StepShape(0, 0, 0, 0)
                    if is_step:
                        t = next(timed)
                        for draft_shape in t.draft if stage == 0 else ():
                            v = small.values(draft_shape, draft.device)
                            stage_stats(small, v, stats)
                            yield proposer, v
                        shape = t.shape
                    v = template.values(shape, engine.device)
                    stage_stats(template, v, stats)
                    yield writers[id(template)], v

            write_class(folder, steps(), members[cls], lambda r: workload.hole_values(r, holes))
            classes.append({"class": cls, "stage": stage, "replica": None if shared else replica,
                            "count": len(members[cls]), **_stats_dict(stats)})
        summary["rank_classes"] = classes
        summary["rank_class"] = [workload.class_of(r) for r in range(world)]
        for entry, log in zip(summary["replicas"], write_iterations(folder, out, replicas, "replica")):
            entry["iterations"] = log
        summary["iterations_file"] = ITERATIONS_FILE
        dump_summary(folder / "summary.json", summary)
        commit_output(folder, out)
    except OSError as err:
        shutil.rmtree(folder, ignore_errors=True)
        raise OutputError(f"output {out}: write failed ({err.strerror})") from None
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise


def _stats_dict(stats: dict) -> dict:
    return {"flops": stats.get("flops", 0), "compute_bytes": stats.get("compute_bytes", 0),
            "comm_bytes": dict(sorted(stats.get("comm_bytes", {}).items())),
            "comm_count": dict(sorted(stats.get("comm_count", {}).items())),
            "send_bytes": stats.get("send_bytes", 0), "recv_bytes": stats.get("recv_bytes", 0),
            "nodes": dict(sorted(stats.get("nodes", {}).items()))}


def _header(model, plan, mode, kv) -> dict:
    return {
        "stg_version": __version__,
        "model": {**model.describe(), "source": model.source},
        "mode": mode.value,
        "serve_plan": plan.to_dict(),
        "mesh": dict(plan.parallel().mesh().axes) | {"dp": plan.dp},  # dp: the replicas
        "world_size": plan.dp * plan.ep * plan.tp * plan.pp,
        "kv_cache": {**kv.to_dict(), "kv_bytes_per_token_per_layer": kv_bytes_per_token_per_layer(
            model.config, plan.kv_cache_dtype)},
        "cost_model": "device roofline per compute node + alpha-beta collectives (5 us, 50 GB/s), stages in sequence",
    }


def _summary(model, plan, mode, engine, kv, replicas, requests, slo_ttft_ms, slo_tpot_ms) -> dict:
    summary = {**_header(model, plan, mode, kv), "replicas": []}
    for index, timed in enumerate(replicas):
        entry = {"replica": index, "iterations": None,  # an IterationLog once written (stg/serve/records.py)
                 "makespan_s": timed[-1].end_s if len(timed) else 0.0}
        if mode is Mode.SERVE:
            mine = list(requests[index::plan.dp])
            rows = request_metrics(mine, timed)
            entry["requests"] = rows
            entry["totals"] = totals(rows, entry["makespan_s"], _s(slo_ttft_ms), _s(slo_tpot_ms))
        summary["replicas"].append(entry)
    if mode is Mode.SERVE:
        rows = [row for entry in summary["replicas"] for row in entry["requests"]]
        makespan = max(entry["makespan_s"] for entry in summary["replicas"])
        summary["totals"] = totals(rows, makespan, _s(slo_ttft_ms), _s(slo_tpot_ms))
    return summary


def _s(ms: float | None) -> float | None:
    return None if ms is None else ms / 1e3
