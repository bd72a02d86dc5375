"""A plan's pipeline timed from two short probes instead of all its micro-batches.

The slice replay costs time in proportion to the micro-batches. Past its warm-up a pipeline
schedule repeats itself: the step is a max-plus linear system of identical micro-batches, and
its completion times settle into a periodic regime in which every further micro-batch (every
further group of pp for the interleaved schedule, whose micro-batch count is a multiple of
pp) adds the same time to each stage, possibly over a cycle of a few micro-batches (Cohen et
al., "A linear-system-theoretic view of discrete-event processes", 1983; Baccelli et al.,
"Synchronization and Linearity", 1992). So a plan of m micro-batches is timed at m1 = 3 pp
and m2 = 6 pp micro-batches (whole cycles, well past the warm-up) and its replayed times are
extended linearly to m:

    T(m) = T(m1) + (m - m1) / (m2 - m1) * (T(m2) - T(m1))

for the step (makespan), each stage's busy and idle time, with free and with costed
communication. Only a plan with m > 12 pp gains enough to be probed; the others are replayed
whole. Over 96 plans (pp 2 and 4; GPipe, 1F1B, interleaved, ZB-H1; ZeRO 0/1/3; tp 1/2; m = 16
pp and 12 pp) the extended step was within 0.14 % of the whole replay (closer probes, 2 pp
and 2 pp + 1, were off by up to 1.8 %: ZB-H1 with ZeRO-3 settles slowly). Memory and FLOPs are
the plan's own (stg.api.build without nodes); only the replay is shortened. Without a
pipeline (pp = 1) the step is m identical micro-batches of gradient accumulation, the last
one flushing the gradient buckets: the same rule applies (m > 12 probed at 3 and 6), within
0.1 % over dp with ZeRO 0-3, tp with and without sp, cp and full recomputation, m = 26 (the
rest is each COMP node's rounding to whole microseconds).
tests/test_explore.py holds the result to the replay of the whole plan.
"""

from __future__ import annotations

from dataclasses import replace

from stg.api import build
from stg.chakra.replay import Timing
from stg.explore.cost import slice_timings
from stg.explore.network import Network
from stg.plan import Plan


def probe_counts(plan: Plan) -> tuple[int, int] | None:
    """The two micro-batch counts to replay, or None when the plan itself is as cheap."""
    if plan.microbatches <= 12 * plan.pp:
        return None
    return 3 * plan.pp, 6 * plan.pp


def _extend(a: Timing, b: Timing, scale: float) -> Timing:
    line = lambda x, y: x + scale * (y - x)
    return Timing(line(a.makespan_us, b.makespan_us), [line(x, y) for x, y in zip(a.busy_us, b.busy_us)],
                  [line(x, y) for x, y in zip(a.idle_us, b.idle_us)],
                  [line(x, y) for x, y in zip(a.finish_us, b.finish_us)])


def plan_timings(model, plan: Plan, network: Network) -> list[tuple[Timing, Timing]]:
    """Per variant, the (free, costed) timings of one pipeline slice of `plan`."""
    counts = probe_counts(plan)
    if counts is None:
        workload = build(model, plan, timing=True)
        return [slice_timings(workload, network, v) for v in range(workload.variants)]
    runs = []
    for microbatches in counts:
        probe = replace(plan, global_batch=microbatches * plan.micro_batch * plan.data_ranks)
        workload = build(model, probe, timing=True)
        runs.append([slice_timings(workload, network, v) for v in range(workload.variants)])
    scale = (plan.microbatches - counts[0]) / (counts[1] - counts[0])
    return [(_extend(f1, f2, scale), _extend(t1, t2, scale)) for (f1, t1), (f2, t2) in zip(*runs)]
