"""A plan's pipeline timed from shorter ones: two with fewer micro-batches, or two or four folded.

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
and 2 pp + 1, were off by up to 1.8 %: ZB-H1 with ZeRO-3 settles slowly). The interleaved
schedule is probed at 2 pp and 4 pp when m > 8 pp: over 12 plans (pp 4 and 8, ZeRO 0/1/3,
tp 1/2, m = 16 pp) within 0.22 % of the whole replay (3 pp and 6 pp: 0.18 %; 2 pp and 3 pp:
0.86 %). Memory and FLOPs are the plan's own (stg.api.build without nodes); only the replay is shortened. Without a
pipeline (pp = 1) the step is m identical micro-batches of gradient accumulation, the last
one flushing the gradient buckets: the same rule applies (m > 12 probed at 3 and 6), within
0.1 % over dp with ZeRO 0-3, tp with and without sp, cp and full recomputation, m = 26 (the
rest is each COMP node's rounding to whole microseconds).

A long pipeline is also folded. Its replay costs pp x m stage micro-batches, but the middle
stages of a cut that gives them the same blocks run one program up to names and peers, and
the step of such a pipeline is bilinear in its stage and micro-batch counts once it holds at
least two middle stages (four in all) and is past the fill's transient. So a plan whose cut
has a run of alike middle stages, m >= 2 pp micro-batches and pp >= 2 p2 stages is timed
from four folded pipelines -- the same model with fewer of those middle blocks, the stages
before and after the run kept as they are; p1 and p2 stages, m1 = 6 p2 and m2 = 12 p2
micro-batches -- and every time (the step, each stage's busy time and finish) is

    T(pp, m) = a + b pp + c m + d pp m,  fitted exactly on the four,

each stage taking its counterpart's (the same stage from its end of the pipeline, or the
first of the alike middle ones). p1 and p2 keep pp's place in the network's period along the
stages (ranks are pp-major: with 4 ranks a stage on nodes of 8 the links between stages
alternate NVLink and InfiniBand, period 2): p1 >= 4 with p1 = pp mod the period, p2 = p1 + 2
or + a period. Measured against the whole replay: a llama3-8b-sized layer, tp 2 x dp 2 (period
2), folded at 4 and 6 stages, predicted 8 to 24 stages at m = 2 pp to 6 pp within 0.008 %
under 1F1B, ZB-H1 with ZeRO-3 and GPipe; llama3-70b at pp 16 with its balanced cut (1, 1, 2,
6 x 12, 4) within 0.03 %; folding at 3 and 4 stages, or at 4 and 5 against a period of 2, was
7-73 % off, and probing at 3 p2 and 6 p2 micro-batches left the m-slope 0.2 % short. The
interleaved schedule folds the same way, its virtual stages cut as head, alike middle ones
and tail, its micro-batch counts whole groups of both folds' stages (m1 a multiple of
lcm(p1, p2)): for a 1T layer (tp 8, one block a virtual stage) and for llama3-70b's (tp 2 x
dp 2, period 2), folds at 4 and 6 stages predicted 8 to 48 stages at 48 to 192
micro-batches within 0.01 % of the whole replay. Where p2p latency weighs as much as the
compute (a 1,024-wide layer at seq 512, a block a virtual stage), the slope in pp settles
only past 8 stages and the fold is 0.56 % off at pp 12 (0.15 % at seq 2048). Folding pays
where the folds replay at most a quarter of the plan's stage micro-batches
(4 (m1 + m2)(p1 + p2) <= pp m): the folded models are new structures, whose symbolic passes
(paid once per search, stg/passes.py keeps the recent ones) and first recordings cost about
as much again as the replay they save once the replay is a sweep of the repeats (2026-12-04:
at half, a new llama3-405b pp 32 cut cost 343 ms folded against 111 ms whole, and the 405B
space 1.03-1.19x the CPU of a quarter; the 1T space's time did not move). Under 1F1B and GPipe, whose
step is (m + pp - 1) micro-batch times with or without a steady state, a pipeline is folded
from m = 4 on, and at the plan's own m alone where that replays no more than 6 p2 and 12 p2
would (m <= 18 p2; always for m < pp): two folds, the fit linear in pp, exact in m. Else at
m1 = 6 p2, or 2 p2 where 6 p2 would not pay. Measured against the whole replay: llama3-70b and
llama3-405b layers (tp 4-8, cp 2, ZeRO 1 and 3, full recomputation) at m = pp and 1.5 pp, 16
and 32 stages, within 0.03 %; llama3-405b at m = 8 and 16 on 16-64 stages within 0.025 %;
the small 1,024-wide layer at pp 24 and m = 1.5 pp within 0.35 %, at m = pp / 2 within 0.12 %.
ZB-H1 with ZeRO-3 was 1 % off at m = 1.5 pp on that layer, and an interleaved pipeline of
m = pp (a single round of its micro-batch groups) 0.8-6.8 % off, so those keep m >= 2 pp and
m1 >= 6 p2.
tests/test_explore.py holds both shortcuts to the replay of the whole plan. (The pipelines
with ZeRO-3 above were measured while ZeRO-3 under pp still gathered and reduced per
micro-batch; a pipeline now stores as ZeRO-1 does, parallelism/zero.py.)
"""

from __future__ import annotations

from dataclasses import replace
from math import gcd, lcm

from model_zoo import Model
from model_zoo.transformer import TransformerConfig
from stg.api import build
from stg.chakra.replay import Timing
from stg.explore.cost import slice_timings
from stg.explore.network import Network
from stg.plan import Plan

FOLD_FEWEST = 4  # stages of the smaller folded pipeline: with fewer the fit is off (see above)


def probe_counts(plan: Plan) -> tuple[int, int] | None:
    """The two micro-batch counts to replay, or None when the plan itself is as cheap: 3 pp and
    6 pp; 2 pp and 4 pp for the interleaved schedule."""
    low, high = (2, 4) if plan.vpp > 1 else (3, 6)
    if plan.microbatches <= 2 * high * plan.pp:
        return None
    return low * plan.pp, high * plan.pp


def _extend(a: Timing, b: Timing, scale: float) -> Timing:
    line = lambda x, y: x + scale * (y - x)
    return Timing(line(a.makespan_us, b.makespan_us), [line(x, y) for x, y in zip(a.busy_us, b.busy_us)],
                  [line(x, y) for x, y in zip(a.idle_us, b.idle_us)],
                  [line(x, y) for x, y in zip(a.finish_us, b.finish_us)])


def _replayed(model, plan: Plan, network: Network) -> list[tuple[Timing, Timing]]:
    """Per variant, the (free, costed) timings of one pipeline slice of `plan`, replayed whole
    (its memory is the plan's own, found without nodes: not asked for here)."""
    workload = build(model, plan, timing=True, memory=False)
    return [slice_timings(workload, network, variant) for variant in range(workload.variants)]


def plan_timings(model, plan: Plan, network: Network) -> list[tuple[Timing, Timing]]:
    """Per variant, the (free, costed) timings of one pipeline slice of `plan`."""
    counts = probe_counts(plan)
    if counts is None:
        return _replayed(model, plan, network)
    runs = [_replayed(model, replace(plan, global_batch=microbatches * plan.micro_batch * plan.data_ranks), network)
            for microbatches in counts]
    scale = (plan.microbatches - counts[0]) / (counts[1] - counts[0])
    return [(_extend(f1, f2, scale), _extend(t1, t2, scale)) for (f1, t1), (f2, t2) in zip(*runs)]


def _ends(split: tuple[int, ...]) -> tuple[int, int, int]:
    """(head, middle, tail) of a stage cut: the longest run of stages holding one block count
    (`middle`) between the first and the last stage (which also hold the embedding and the
    output layer), and how many stages come before and after it (the earliest longest run)."""
    runs, start = [], 1  # (length, -start) of each run of equal counts in split[1:-1]
    for end in range(2, len(split)):
        if split[end] != split[start] or end == len(split) - 1:
            runs.append((end - start, -start))
            start = end
    length, start = max(runs, default=(1, -1))
    return -start, split[-start], len(split) + start - length


SHORT_FOLDS = ("1f1b", "gpipe")  # folded from m >= 4 micro-batches on (see above)
FEWEST_MICROBATCHES = 4


def _microbatch_counts(plan: Plan, p1: int, p2: int) -> list[tuple[int, ...]]:
    """The (m1, m2) micro-batches the folds may replay, first choice first: 6 p2 and 12 p2
    (for the interleaved schedule whole groups of both folds' stages); under 1F1B and GPipe
    first (m,), the plan's own alone (the fit then linear in the stages), where that replays
    no more than 6 p2 and 12 p2 do, always for fewer micro-batches than stages, then 6 p2
    and 12 p2, and 2 p2 and 4 p2."""
    m = plan.microbatches
    if plan.schedule in SHORT_FOLDS:
        return [(m,)] if m < plan.pp else [(m,)] * (m <= 18 * p2) + [(6 * p2, 12 * p2), (2 * p2, 4 * p2)]
    group = lcm(p1, p2) if plan.vpp > 1 else 1
    m1 = group * -(-6 * p2 // group)
    return [(m1, 2 * m1)]


def _pays(plan: Plan, p1: int, p2: int, counts: tuple[int, ...]) -> bool:
    """The folds of p1 and p2 stages at `counts` micro-batches replay at most a quarter of the
    stage micro-batches of `plan` (their structures cost about as much again: see above)."""
    return 4 * sum(counts) * (p1 + p2) <= plan.pp * plan.microbatches


def may_fold(plan: Plan) -> bool:
    """Whether `plan` can be folded at all (fold_counts then needs its cut and the network):
    long enough for two folds of at least 4 and 6 stages, past the fill (m >= 2 pp; m >= 4
    under 1F1B and GPipe), and the least such folds pay (_pays)."""
    p1, p2 = FOLD_FEWEST, FOLD_FEWEST + 2
    least = FEWEST_MICROBATCHES if plan.schedule in SHORT_FOLDS else 2 * plan.pp
    return (plan.pp >= 2 * p2 and plan.microbatches >= least
            and any(_pays(plan, p1, p2, counts) for counts in _microbatch_counts(plan, p1, p2)))


def fold_counts(workload, network: Network) -> tuple[tuple[int, int], tuple[int, ...]] | None:
    """((p1, p2), (m1, m2) or (m,)): the stage and micro-batch counts of the folded pipelines that
    time `workload`'s plan (built without nodes), or None when it cannot be folded or gains
    nothing by it."""
    plan, config = workload.plan, workload.model.config
    if not may_fold(plan) or not isinstance(config, TransformerConfig):
        return None
    split = workload.stages.split(config.layers)
    head, middle, tail = _ends(split)
    if len(split) - head - tail < 2:
        return None  # fewer than two alike middle stages: nothing to fold
    if config.first_dense_layers > sum(split[:head]):
        return None  # a dense block (DeepSeek's first ones) in a middle stage
    stride = workload.mesh.stride("pp")
    period = lcm(*(tier.size // gcd(tier.size, stride) for tier in network.tiers if tier.size))
    # at least two middle stages and four in all, as many fewer than pp as whole periods
    fewest = max(FOLD_FEWEST, head + tail + 2)
    p1 = plan.pp - period * ((plan.pp - fewest) // period)
    p2 = p1 + period * -(-2 // period)
    if plan.pp < 2 * p2:
        return None
    # past the fill's transient (at 3 and 6 p2 the slope in m was 0.2 % short), or as the
    # schedule allows (_microbatch_counts)
    for counts in _microbatch_counts(plan, p1, p2):
        if _pays(plan, p1, p2, counts):
            return (p1, p2), counts
    return None  # the folds cost a quarter of the plan or more


def folded_timings(model: Model, workload, network: Network) -> list[tuple[Timing, Timing]] | None:
    """Per variant, the (free, costed) timings of `workload`'s pipeline slice fitted from four
    folded pipelines (two at the plan's own micro-batches), or None when the plan is not folded
    (fold_counts)."""
    found = fold_counts(workload, network)
    if found is None:
        return None
    (p1, p2), counts = found
    plan, split = workload.plan, workload.stages.split(model.layers)
    head, middle, tail = _ends(split)
    runs = {}
    for p in (p1, p2):
        cut = (*split[:head], *[middle] * (p * plan.vpp - head - tail), *split[len(split) - tail:])
        folded = Model(replace(model.config, layers=sum(cut)), model.source)
        for m in counts:
            probe = replace(plan, pp=p, layers_per_stage=cut, global_batch=m * plan.micro_batch * plan.data_ranks)
            runs[p, m] = _replayed(folded, probe, network)

    def fit(value) -> float:
        """value(p, m) at (pp, m), from the runs: bilinear in p and m, or linear in p."""
        x = (plan.pp - p1) / (p2 - p1)
        a, b = value(p1, counts[0]), value(p2, counts[0])
        if len(counts) == 1:
            return a + x * (b - a)
        c, d = value(p1, counts[1]), value(p2, counts[1])
        y = (plan.microbatches - counts[0]) / (counts[1] - counts[0])
        return a + x * (b - a) + y * (c - a) + x * y * (d - c - b + a)

    # a real stage's counterpart in a folded pipeline of p stages: the same from either end,
    # or (a middle one, all alike) the first middle stage
    counterpart = lambda stage, p: stage if stage < head else p - (plan.pp - stage) if plan.pp - stage <= tail else head

    def timing(variant: int, costed: int) -> Timing:
        at = lambda p, m: runs[p, m][variant][costed]
        makespan = fit(lambda p, m: at(p, m).makespan_us)
        per_stage = lambda of: [fit(lambda p, m: getattr(at(p, m), of)[counterpart(stage, p)])
                                for stage in range(plan.pp)]
        busy = per_stage("busy_us")
        return Timing(makespan, busy, [makespan - b for b in busy], per_stage("finish_us"))

    return [(timing(variant, 0), timing(variant, 1)) for variant in range(len(runs[p1, counts[0]]))]
