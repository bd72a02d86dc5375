"""Plan search speed and a public plan (issue 13).

    python benchmarks/bench_explore.py [--skip-405b] [--agreement] [--1t [--workers 2]] [--405b-space [--by-kind]]

1. Plans per second (CPU time of this process) for llama3-8b on 64 H100s and llama3-70b on
   256 and on 64 H100s (every plan built by stg.api.build, timed by the slice replay; a plan over
   the device's memory is refused before its programs are lowered).
2. Llama 3 405B on 16,384 H100s, seq 8192, 16M tokens per step (2,048 sequences): the plan
   Meta published (tp 8, cp 1, pp 16, dp 128; Llama 3 paper, Dubey et al. 2024, Table 4),
   with 1F1B and interleaved schedules: peak memory per rank against 80 GiB, step time and MFU
   (Meta reports 38-43 % BF16 MFU for its 8K-sequence pretraining on 8K-16K GPUs).
3. Side by side, long pipelines (64-128 micro-batches) timed by replaying every micro-batch
   and from two probes (stg/explore/probe.py): CPU-s ratio and the step-time difference.
4. Side by side, pipelines of 16 stages and 512 micro-batches (1F1B, ZB-H1) and of 20 stages
   and 240 micro-batches (interleaved) timed whole and from four folded ones
   (stg/explore/probe.py): CPU-s ratio and the step-time difference.
5. --1t: the default space of megatron-1t on 512 H100s (global batch 3,072, seq 2,048), wall
   time with --workers processes (issue 13: under 60 s on the 2-core machine).
6. --405b-space: the default space of llama3-405b on 16,384 H100s (seq 8192, 2,048 sequences),
   plans per CPU-second in one process (issue 13 asks for 200); then a wider one (ZeRO 0-3,
   micro-batches of 1, 2 and 4, 1F1B, interleaved and ZB-H1: nine times the plans), where a
   structure's and a stage cut's first costs are shared by more plans. With --by-kind, each
   space's CPU by plan outcome, pipeline depth and schedule.
7. --agreement: for a few plans, the estimate against `stg validate --timed alpha-beta
   --network` of the written set (relative difference).
8. With --405b-space: the warm per-plan floor, four llama3-405b plans each evaluated again
   with every cache of its structure, cut and sizes warm (milliseconds of CPU): what a plan
   costs that shares everything with one seen before. 200 plans per CPU-second is 5 ms.
9. With --405b-space, side by side: the same four plans' slices replayed from their repeats
   (stg/chakra/repeat_paths.py, explore's) and from their rows, made, laid out and swept once
   per cost (stg/chakra/longest_paths.py, explore's before): CPU ratio; the timings equal.
10. With --405b-space, the ceiling before any timing: each 405B space's plans evaluated for
   memory and FLOPs alone by stg.evaluate (short forms, no lowering, no replay), in a fresh
   process, cold and then again warm: the valid plans per CPU-second explore could reach
   if timing cost nothing at all.
"""

from __future__ import annotations

import argparse
import multiprocessing
import tempfile
import time
from collections import Counter
from dataclasses import replace

from model_zoo import load_model
from stg.api import build, generate
from stg.chakra.validate import timed_replay
from stg.errors import StgError
from stg.evaluation import evaluate
from stg.explore import Cluster, Job, Space, explore, load_network, search
from stg.chakra.replay import CommCost
from stg.explore.cost import estimate, group_spans
from stg.explore.probe import fold_counts, folded_timings, plan_timings
from stg.explore.space import plans as space_plans, resolve
from stg.plan import Plan
from stg.slice_check import slice_paths, slice_ranks

NETWORK = "dgx-h100-superpod"
# the wider 405B space: ZeRO 0-3, micro-batches of 1, 2 and 4, three schedules
WIDER = Space(zero=(0, 1, 2, 3), micro_batch=(1, 2, 4), schedule=("1f1b", "interleaved", "zb-h1"))


def rate(name: str, model: str, cluster: Cluster, job: Job, space: Space = Space(), workers: int = 1,
         by_kind: bool = False) -> None:
    """Plans per CPU-second of this process (workers = 1), or the wall time with `workers`;
    `by_kind`: then where that CPU went, by plan outcome, pipeline depth and schedule (each
    plan timed as it is evaluated: the first plan of a structure or a stage cut pays its first
    costs)."""
    kinds: dict[tuple, list] = {}
    if by_kind:
        evaluate = search.evaluate

        def timed(model, plan, network, capacity):
            started, outcome = time.process_time(), "valid"
            try:
                return evaluate(model, plan, network, capacity)
            except StgError as error:
                outcome = type(error).__name__
                raise
            finally:
                kind = kinds.setdefault((outcome, plan.pp, plan.schedule), [0.0, 0])
                kind[0] += time.process_time() - started
                kind[1] += 1
        search.evaluate = timed
    cpu, wall = time.process_time(), time.perf_counter()
    try:
        result = explore(model, cluster, job, space, workers=workers)
    finally:
        if by_kind:
            search.evaluate = evaluate
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    best = result.rows[0].to_dict() if result.rows else {}
    speed = (f"{cpu:.1f} CPU-s: {result.considered / cpu:.2f} plans/CPU-s, {len(result.rows) / cpu:.2f} evaluated/CPU-s"
             if workers == 1 else f"{wall:.0f} s wall on {workers} workers")
    print(f"{name}: {result.considered} plans ({len(result.rows)} valid, dropped {result.dropped}) in {speed}; "
          f"best: {({k: best[k] for k in ('dp', 'tp', 'pp', 'schedule', 'recompute', 'micro_batch')} if best else None)} "
          f"step {best.get('step_ms', 0):.0f} ms MFU {best.get('mfu', 0):.1%}")
    for (outcome, pp, schedule), (seconds, plans) in sorted(kinds.items(), key=lambda kv: -kv[1][0])[:12]:
        print(f"  {outcome} pp {pp} {schedule}: {plans} plans, {seconds:.2f} CPU-s ({seconds / cpu:.0%}), "
              f"{seconds / plans * 1e3:.1f} ms a plan")


def _summaries(space: Space) -> str:
    """stg.evaluate of the 405B space's plans (those Plan accepts), cold and then warm."""
    model, cluster = load_model("llama3-405b"), Cluster(gpus=16384)
    candidates = list(space_plans(resolve(space, cluster, model.layers, None), cluster,
                                  Job(global_batch=2048, seq=8192), Counter(), model.layers))
    times = []
    for _ in range(2):
        started = time.process_time()
        rows = list(evaluate(model, candidates))
        times.append(time.process_time() - started)
    fits = sum("error" not in row and max(c["memory"]["peak"] for c in row["rank_classes"]) <= 80 * 2**30
               for row in rows)
    return (f"{len(candidates)} plans, {fits} fit: {times[0]:.1f} CPU-s cold ({fits / times[0]:.1f} fitting plans "
            f"per CPU-s), {times[1]:.1f} warm ({fits / times[1]:.1f})")


def summary_ceiling() -> None:
    """Each 405B space's memory and FLOPs alone, each in a fresh process (its caches cold)."""
    spaces = {"default": Space(), "wider": WIDER}
    with multiprocessing.get_context("spawn").Pool(1, maxtasksperchild=1) as pool:
        for name, space in spaces.items():
            print(f"  {name} space, memory and FLOPs alone (stg.evaluate): {pool.apply(_summaries, (space,))}")


def meta_405b() -> None:
    network = load_network(NETWORK)
    for schedule, vpp in (("1f1b", 1), ("interleaved", 2)):
        plan = Plan(dp=128, tp=8, pp=16, cp=1, zero=1, micro_batch=1, global_batch=2048, seq=8192,
                    schedule=schedule, vpp=vpp, layers_per_stage="auto")
        started = time.process_time()
        workload = build("llama3-405b", plan)
        e = estimate(workload, network)
        print(f"llama3-405b tp8 cp1 pp16 dp128 {schedule} vpp{vpp}, 16,384 x h100, {NETWORK}: peak "
              f"{e.peak_memory / 2**30:.1f} GiB per rank ({'fits' if e.peak_memory <= 80 * 2**30 else 'OVER'} 80 GiB), "
              f"step {e.step_us / 1e6:.2f} s, {e.tokens_per_s / 1e6:.2f} M tokens/s, MFU {e.mfu:.1%}, bubble "
              f"{e.bubble:.1%}, exposed comm {e.exposed_comm_us / 1e6:.2f} s "
              f"[{time.process_time() - started:.1f} CPU-s]")


# tp, pp, schedule, vpp
WARM_PLANS = ((8, 16, "1f1b", 1), (8, 64, "1f1b", 1), (8, 32, "interleaved", 2), (4, 8, "1f1b", 1))


def warm_floor() -> None:
    """Per plan, the CPU of evaluating it again in this process (median of 5): what is left of
    a plan once its structure's passes, its cut's recordings and its sizes are known."""
    from stg.explore.search import evaluate

    network, model = load_network(NETWORK), load_model("llama3-405b")
    for tp, pp, schedule, vpp in WARM_PLANS:
        plan = Plan(dp=16384 // (tp * pp), tp=tp, sp=True, pp=pp, vpp=vpp, schedule=schedule, zero=1, recompute="full",
                    global_batch=2048, seq=8192, layers_per_stage="auto")
        evaluate(model, plan, network, 80 * 2**30)
        times = []
        for _ in range(5):
            started = time.process_time()
            evaluate(model, plan, network, 80 * 2**30)
            times.append(time.process_time() - started)
        print(f"  warm llama3-405b tp{tp} pp{pp} {schedule} ({plan.microbatches} micro-batches): "
              f"{sorted(times)[2] * 1e3:.0f} ms a plan")


def replays() -> None:
    """Side by side on warm slices: replayed from their repeats, and from their rows (made
    afresh each time, as a timing build used to make them: the programs copied, so no cache
    holds their rows)."""
    network, model = load_network(NETWORK), load_model("llama3-405b")
    repeats_s = rows_s = 0.0
    for tp, pp, schedule, vpp in WARM_PLANS:
        plan = Plan(dp=16384 // (tp * pp), tp=tp, sp=True, pp=pp, vpp=vpp, schedule=schedule, zero=1, recompute="full",
                    global_batch=2048, seq=8192, layers_per_stage="auto")
        workload = build(model, plan, timing=True)
        ranks = slice_ranks(workload)
        costs = [CommCost(), network.bound(group_spans(workload, ranks), ranks, workload.mesh.size)]
        for _ in range(5):
            started = time.process_time()
            ours = slice_paths(workload, ranks).runs(costs)
            repeats_s += time.process_time() - started
            fresh = replace(workload, programs=tuple(replace(program) for program in workload.programs))
            started = time.process_time()
            theirs = slice_paths(fresh, ranks, repeats=False).runs(costs)
            rows_s += time.process_time() - started
            assert ours == theirs
    print(f"slice replays from repeats / from rows: {repeats_s:.2f} / {rows_s:.2f} CPU-s = "
          f"{repeats_s / rows_s:.2f}x (four warm llama3-405b slices, five times each; the same timings)")


def probes() -> None:
    """Side by side: long pipelines timed by replaying all their micro-batches and from two
    probes (stg/explore/probe.py), in one process: the time ratio and the step difference."""
    network = load_network(NETWORK)
    plans = [Plan(dp=8, tp=2, pp=4, zero=1, global_batch=512, seq=4096),
             Plan(dp=8, tp=2, pp=4, schedule="interleaved", vpp=2, global_batch=512, seq=4096),
             Plan(dp=16, tp=1, pp=4, schedule="zb-h1", zero=1, global_batch=1024, seq=4096)]
    whole_s = probed_s = 0.0
    for plan in plans:
        started = time.process_time()
        whole = estimate(build("llama3-8b", plan), network)
        whole_s += time.process_time() - started
        started = time.process_time()
        probed = estimate(build("llama3-8b", plan, nodes=False), network, plan_timings("llama3-8b", plan, network))
        probed_s += time.process_time() - started
        print(f"  llama3-8b dp{plan.dp} tp{plan.tp} pp{plan.pp} {plan.schedule}, {plan.microbatches} micro-batches: "
              f"step {whole.step_us / 1e3:.1f} ms whole, {probed.step_us / 1e3:.1f} ms probed "
              f"({abs(probed.step_us - whole.step_us) / whole.step_us:.3%})")
    print(f"whole replay / probed: {whole_s:.1f} / {probed_s:.1f} CPU-s = {whole_s / probed_s:.1f}x faster")


def folds() -> None:
    """Side by side: long pipelines timed by replaying all their stages and micro-batches and
    from four folded pipelines (stg/explore/probe.py), in one process: CPU ratio, step difference."""
    network = load_network(NETWORK)
    plans = [Plan(dp=2, tp=8, pp=16, zero=1, global_batch=1024, seq=4096, layers_per_stage="auto"),
             Plan(dp=2, tp=8, pp=16, schedule="zb-h1", zero=1, global_batch=1024, seq=4096, layers_per_stage="auto"),
             # 80 blocks, two a virtual stage (its balanced cut leads with 7 one-block stages: not folded)
             Plan(dp=2, tp=8, pp=20, schedule="interleaved", vpp=2, zero=1, global_batch=480, seq=4096)]
    whole_s = folded_s = 0.0
    for plan in plans:
        build("llama3-70b", plan, nodes=False)  # the structure, shared by both
        started = time.process_time()
        whole = estimate(build("llama3-70b", plan, timing=True), network)
        whole_s += time.process_time() - started
        started = time.process_time()
        counted = build("llama3-70b", plan, nodes=False)
        folded = estimate(counted, network, folded_timings(counted.model, counted, network))
        folded_s += time.process_time() - started
        print(f"  llama3-70b dp{plan.dp} tp{plan.tp} pp{plan.pp} {plan.schedule}, {plan.microbatches} micro-batches, "
              f"folded at {fold_counts(counted, network)}: step {whole.step_us / 1e3:.1f} ms whole, "
              f"{folded.step_us / 1e3:.1f} ms folded ({abs(folded.step_us - whole.step_us) / whole.step_us:.3%})")
    print(f"whole replay / folded: {whole_s:.1f} / {folded_s:.1f} CPU-s = {whole_s / folded_s:.1f}x faster "
          "(the folded models' symbolic passes included)")


def agreement() -> None:
    network = load_network(NETWORK)
    plans = [Plan(dp=2, tp=4, pp=2, zero=1, global_batch=16, seq=2048),
             Plan(dp=4, tp=2, pp=2, schedule="interleaved", vpp=2, global_batch=16, seq=2048, recompute="full"),
             Plan(dp=2, tp=2, cp=2, pp=2, schedule="zb-h1", zero=1, global_batch=8, seq=2048),
             Plan(dp=8, tp=2, zero=3, global_batch=16, seq=2048)]
    for plan in plans:
        with tempfile.TemporaryDirectory() as out:
            ours = estimate(build("llama3-8b", plan), network).step_us
            generate("llama3-8b", plan, out)
            theirs = timed_replay(out, comm="alpha-beta", network=network).makespan_us
        print(f"dp{plan.dp} tp{plan.tp} cp{plan.cp} pp{plan.pp} {plan.schedule} zero{plan.zero} "
              f"{plan.recompute.value}: explore {ours / 1e3:.2f} ms, timed replay {theirs / 1e3:.2f} ms, "
              f"difference {abs(ours - theirs) / theirs:.3%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-405b", action="store_true")
    parser.add_argument("--agreement", action="store_true")
    parser.add_argument("--1t", dest="one_t", action="store_true", help="also the 1T space (minutes)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--405b-space", dest="space_405b", action="store_true",
                        help="also the default space of llama3-405b on 16,384 GPUs (minutes)")
    parser.add_argument("--by-kind", action="store_true",
                        help="with --405b-space: where each 405B space's CPU went, by plan outcome, pp and schedule")
    args = parser.parse_args()
    rate("llama3-8b on 64 x h100", "llama3-8b", Cluster(gpus=64), Job(global_batch=256, seq=8192),
         Space(tp=(1, 2, 4, 8), pp=(1, 2, 4), recompute=("none", "full"), micro_batch=(1,), schedule=("1f1b",)))
    rate("llama3-70b on 256 x h100", "llama3-70b", Cluster(gpus=256), Job(global_batch=512, seq=4096),
         Space(tp=(4, 8), pp=(4, 8), recompute=("none", "full"), micro_batch=(1,), schedule=("1f1b",)))
    # most of this space does not fit 80 GiB: refused before lowering, so it is cheap to drop
    rate("llama3-70b on 64 x h100, a wide space", "llama3-70b", Cluster(gpus=64), Job(global_batch=128, seq=4096),
         Space(tp=(1, 2, 4, 8), pp=(1, 2, 4, 8), zero=(0, 1), recompute=("none", "full"), micro_batch=(1,),
               schedule=("1f1b",)))
    probes()
    folds()
    if args.one_t:  # the space Calculon searches in 317 CPU-s
        rate("megatron-1t on 512 x h100, default space", "megatron-1t", Cluster(gpus=512),
             Job(global_batch=3072, seq=2048), workers=args.workers)
    if args.space_405b:
        rate("llama3-405b on 16,384 x h100, default space", "llama3-405b", Cluster(gpus=16384),
             Job(global_batch=2048, seq=8192), by_kind=args.by_kind)
        rate("llama3-405b on 16,384 x h100, a wider space", "llama3-405b", Cluster(gpus=16384),
             Job(global_batch=2048, seq=8192), WIDER, by_kind=args.by_kind)
        warm_floor()
        replays()
        summary_ceiling()
    if not args.skip_405b:
        meta_405b()
    if args.agreement:
        agreement()


if __name__ == "__main__":
    main()
