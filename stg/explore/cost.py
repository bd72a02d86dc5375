"""The step time of a plan: stg's timed replay of one pipeline slice, costed by a network.

No second formula: the rank-class programs that `stg generate` would write are replayed with
TimedReplay's rules and numbers (stg/chakra/replay.py; computed as longest paths,
stg/chakra/longest_paths.py, or by its loop compiled, stg/chakra/replay_kernel.py), one rank per
pipeline stage (stg/slice_check.py), COMP nodes taking their duration from the device roofline
that lowering already put on them, collectives and sends their time on the network
(stg/explore/network.py); the programs are lowered for timing only (stg.api.build(timing=True):
the same stats and replay, no trace nodes). A collective over
tp, dp, cp or ep joins copies of this slice that run the same programs at the same times, so it
starts when this slice's member joins and costs what its real group (its size, the tiers it
spans) costs: the slice's makespan is the whole set's, as `stg validate --timed alpha-beta
--network` measures it, at a cost independent of dp, tp, cp and ep.

Run twice, with free and with costed communication: the free run's idle time is the pipeline
bubble, the difference of the two makespans the communication that compute did not hide.

Lowering orders each rank's compute and its collectives and sends in one chain each, so no
node ever waits for a busy resource: the replay's times are the longest paths through the
slice's nodes (a max-plus system), which tests/test_evaluate.py checks against an independent
longest-path schedule (tests/helpers.py) for every strategy. So a step's time composes from
its actions' (each a max-plus map of the times it starts from), and past a transient it
grows periodically over alike micro-batches, which stg/explore/probe.py fits.
"""

from __future__ import annotations

from dataclasses import dataclass

from stg.chakra.replay import CommCost, TimedReplay
from stg.chakra.replay_kernel import CompiledReplay
from stg.device import device_spec
from stg.explore.network import Network
from stg.program import GroupHole
from stg.slice_check import rank_graphs, replay_durations, slice_paths, slice_ranks


@dataclass(frozen=True)
class Estimate:
    """One plan's step, per the slice replay; times in µs, memory in bytes per rank."""

    step_us: float
    compute_us: float  # the busiest stage's COMP time
    bubble: float  # idle fraction of the step under free communication, mean over stages
    exposed_comm_us: float  # step time the communication adds over free communication
    model_flops: int  # forward + backward FLOPs of all ranks, recomputation excluded
    peak_memory: int  # the largest rank class's peak
    memory: dict  # that class's breakdown (Memory.to_dict)
    tokens: int  # per step
    world: int
    peak_flops: float  # per GPU, FLOP/s, of the plan's dtype

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / (self.step_us * 1e-6)

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation (PaLM's definition: model FLOPs, no recomputation, per peak)."""
        return self.model_flops / (self.step_us * 1e-6 * self.world * self.peak_flops)


def group_spans(workload, ranks: list[int]) -> dict[int, tuple[int, int, int]]:
    """Each group the slice's ranks talk on, with the size, lowest and highest rank of its
    members in the whole set (Network.bound)."""
    spans: dict[int, tuple[int, int, int]] = {}
    ids = workload.group_ids
    for rank in ranks:
        for hole in workload.programs[workload.class_of(rank)].holes:
            if isinstance(hole, GroupHole) and (group := ids.id(rank, hole)) not in spans:
                spans[group] = ids.span(rank, hole)
    return spans


def slice_timings(workload, network: Network, variant: int = 0):
    """The Timings of one pipeline slice under free communication and on `network`."""
    ranks = slice_ranks(workload, variant)
    costs = CommCost(), network.bound(group_spans(workload, ranks), ranks, workload.mesh.size)
    paths = slice_paths(workload, ranks)  # read-only to the replay: laid out once, run twice
    timings = tuple(paths.runs(costs))
    if None not in timings:
        return timings
    # the sweep stalled: the event queue's numbers, compiled; TimedReplay itself says why a run
    # that hangs hangs
    graphs, members = rank_graphs(workload, ranks)
    durations = [replay_durations(workload.programs[workload.class_of(rank)]) for rank in ranks]
    compiled = CompiledReplay(graphs, members, durations)
    return tuple(compiled.run(cost) or TimedReplay(graphs, members, durations, cost).run() for cost in costs)


def peak_tflops(plan, model) -> float:
    """The device's dense peak for the plan's dtype (fp8, tf32 for fp32 models, else bf16)."""
    dtype = getattr(model.config, "dtype", None)
    device = device_spec(plan.device)
    return device.fp8_tflops if plan.fp8 else device.tf32_tflops if dtype == "fp32" else device.peak_tflops


def estimate(workload, network: Network, timings: list | None = None) -> Estimate:
    """The step time, bubble, exposed communication, MFU and memory of a built plan;
    `timings`: its slices' (free, costed) Timings per variant, when they were found otherwise
    (stg/explore/probe.py; then the workload needs no nodes)."""
    plan = workload.plan
    runs = timings or [slice_timings(workload, network, v) for v in range(workload.variants)]
    free = max((f for f, _ in runs), key=lambda t: t.makespan_us)
    timed = max((t for _, t in runs), key=lambda t: t.makespan_us)
    bubble = sum(free.idle_us) / (len(free.idle_us) * free.makespan_us) if free.makespan_us else 0.0
    model_flops = 0
    for cls, program in enumerate(workload.programs):
        stats = program.stats.to_dict()
        model_flops += (stats["flops_forward_backward"] - stats["flops_recompute"]) * workload.class_count(cls)
    heaviest = max(range(len(workload.memory)), key=lambda c: workload.memory[c].peak)
    peak = peak_tflops(plan, workload.model) * 1e12
    return Estimate(step_us=timed.makespan_us, compute_us=max(timed.busy_us), bubble=bubble,
                    exposed_comm_us=timed.makespan_us - free.makespan_us, model_flops=model_flops,
                    peak_memory=workload.memory[heaviest].peak, memory=workload.memory[heaviest].to_dict(),
                    tokens=plan.global_batch * plan.seq, world=workload.mesh.size, peak_flops=peak)
