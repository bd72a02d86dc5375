"""Build cost of a plan (issue 12, "build once, bind many"), measured side by side.

1. A fresh `stg generate --count-only` process per plan (import included): wall seconds and
   peak RSS, for the issue's three plans; then fresh `stg generate` processes writing the sets
   of the plans in the issue's opening table (seq 4096, global batch 64) and of one of 1,024
   ranks to a scratch folder, each then checked by `stg validate` and timed by
   `stg validate --timed alpha-beta`.
2. stg.evaluate over PLANS distinct llama3-405b plans (tp, pp, cp, micro-batch, ZeRO,
   recompute, dp varied) in one process: plans/s, with how many distinct structures (each
   pays the symbolic passes once) they hold, and the time split between a structure's first
   plan, a new stage cut's and the rest.
3. Side by side, plans whose structure is cached: the summary with the nodes lowered (what
   generate and count pay) and without (what evaluate pays), and the ratio.
4. Side by side, stg.evaluate over the same plans in fresh processes, alternating: in one
   process and with --workers forked workers (each taking whole structures), and the ratio.
5. Side by side, the same in one process on the models' short forms (stg/short.py, what
   evaluate runs) and on the full passes, alternating: the ratio, and that the rows agree.

    python benchmarks/bench_build.py [--plans 48] [--workers 2] [--pairs 2]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from child import run_stg

COMMANDS = {
    "llama3-405b tp8 pp16 dp1024": ["llama3-405b", "--tp", "8", "--pp", "16", "--dp", "1024", "--layers-per-stage",
                                    "auto", "--global-batch", "2048", "--seq", "8192"],
    "deepseek-v3 tp8 ep64 pp8": ["deepseek-v3", "--tp", "8", "--dp", "64", "--ep", "64", "--pp", "8",
                                 "--layers-per-stage", "auto", "--global-batch", "512", "--seq", "4096"],
    "llama3-8b dp8": ["llama3-8b", "--dp", "8", "--global-batch", "64", "--seq", "4096"],
}


_ISSUE_TABLE = ["--dp", "4", "--global-batch", "64", "--seq", "4096"]
WRITTEN = {
    "llama3-8b tp8 pp2 dp4": ["llama3-8b", "--tp", "8", "--pp", "2", *_ISSUE_TABLE],
    "llama3-70b tp8 pp4 dp4": ["llama3-70b", "--tp", "8", "--pp", "4", *_ISSUE_TABLE],
    "llama3-405b tp8 pp2 dp4": ["llama3-405b", "--tp", "8", "--pp", "2", *_ISSUE_TABLE],
    # 61 layers: two stages need an uneven split
    "deepseek-v3 tp8 pp2 dp4": ["deepseek-v3", "--tp", "8", "--pp", "2", "--layers-per-stage", "auto", *_ISSUE_TABLE],
    # many ranks (issue 13 had stg validate --timed of 1,024 ranks at ~38 s)
    "llama3-8b tp8 pp2 dp64": ["llama3-8b", "--tp", "8", "--pp", "2", "--dp", "64", "--global-batch", "256",
                               "--seq", "2048"],
}


def fresh_processes() -> None:
    print("fresh process, stg generate --count-only:")
    for label, args in COMMANDS.items():
        wall, rss, _ = run_stg(["generate", *args, "--count-only"])
        print(f"  {label:32s} {wall:6.2f} s  {rss:6.0f} MB")
    print("fresh process, stg generate writing the set, then stg validate and stg validate --timed alpha-beta:")
    for label, args in WRITTEN.items():
        with tempfile.TemporaryDirectory() as scratch:
            wall, rss, _ = run_stg(["generate", *args, "-q", "-o", f"{scratch}/set"])
            size = sum(path.stat().st_size for path in Path(scratch, "set").iterdir())
            checked, _, _ = run_stg(["validate", f"{scratch}/set"])
            timed, _, _ = run_stg(["validate", f"{scratch}/set", "--timed", "alpha-beta"])
        print(f"  {label:32s} {wall:6.2f} s  {rss:6.0f} MB  {size / 1e6:6.0f} MB written; "
              f"validated in {checked:.1f} s, --timed {timed:.1f} s")


def plans(count: int) -> list[dict]:
    """`count` distinct llama3-405b plans drawn (seeded) from dp x tp x pp x cp x micro-batch x
    ZeRO x recompute, seq 8192, 16 micro-batches per data-parallel rank."""
    space = list(itertools.product((1, 2, 4, 8), (1, 2, 3, 6, 7, 9), (1, 2), (1, 2), (0, 1, 2, 3),
                                   ("none", "selective", "full"), (8, 16, 32, 64)))
    chosen = []
    for tp, pp, cp, micro, zero, recompute, dp in random.Random(0).sample(space, count):
        chosen.append(dict(tp=tp, pp=pp, cp=cp, dp=dp, micro_batch=micro, zero=zero, recompute=recompute,
                           global_batch=dp * micro * 16, seq=8192))
    return chosen


def evaluate_rate(count: int) -> None:
    import stg
    import stg.api
    from stg import evaluate, load_model
    from stg.evaluation import structure_order

    model = load_model("llama3-405b")
    model.graph
    chosen = plans(count)
    # one plan at a time in the order stg.evaluate runs them (grouped by structure), each timed
    # and put down as the first plan of its structure, the first of a known structure with new
    # unit degrees or a new stage cut, or one whose structure, unit degrees and cut were seen:
    # where the time goes
    ordered = sorted(chosen, key=lambda p: structure_order(stg.Plan.from_dict(p)))
    kinds, seen, rows = {"new structure": [], "new units or stage cut": [], "seen structure and cut": []}, set(), []
    start = time.perf_counter()
    for plan in ordered:
        began = time.perf_counter()
        rows += evaluate(model, [plan])
        structure, bound, pp = structure_order(stg.Plan.from_dict(plan))
        cut = (structure, bound, pp)
        kind = "new structure" if structure not in seen else "new units or stage cut" if cut not in seen else "seen structure and cut"
        kinds[kind].append(time.perf_counter() - began)
        seen |= {structure, cut}
    seconds = time.perf_counter() - start
    errors = sum("error" in row for row in rows)
    print(f"  {count} plans ({len(kinds['new structure'])} structures, {errors} refused) in {seconds:.1f} s: "
          f"{count / seconds:.2f} plans/s")
    for kind, times in kinds.items():
        if times:
            print(f"    {kind:24s} {len(times):5d} plans, {sum(times):6.2f} s ({sum(times) / seconds:4.0%}), "
                  f"{sum(times) / len(times) * 1e3:7.1f} ms each")
    # side by side on plans whose structure is cached: summaries with and without nodes
    warm = [p for p, row in zip(chosen, rows) if "error" not in row][:8]
    for plan in warm:
        stg.api.build(model, plan, nodes=False)  # every structure in the cache
    timings = {}
    for label, nodes in (("with nodes (as generate lowers)", True), ("without nodes (evaluate)", False)):
        start = time.perf_counter()
        for plan in warm:
            stg.api.build(model, plan, nodes=nodes).summary(per_rank=False)
        timings[label] = (time.perf_counter() - start) / len(warm)
        print(f"  structure cached, {label:34s} {1 / timings[label]:6.2f} plans/s")
    print(f"  ratio: {timings['with nodes (as generate lowers)'] / timings['without nodes (evaluate)']:.1f}x")


_EVALUATE = """
import hashlib, json, sys, time
sys.path.insert(0, {folder!r})
from bench_build import plans
import stg.evaluation
from stg import evaluate, load_model
from stg.api import build
if not {short}:  # the full passes, as before stg/short.py
    stg.evaluation.build = lambda model, plan, **options: build(model, plan, nodes=False)
model = load_model("llama3-405b")
model.graph
chosen = plans({count})
start = time.perf_counter()
rows = list(evaluate(model, chosen, workers={workers}))
print(json.dumps([time.perf_counter() - start, sum("error" in row for row in rows),
                  hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()]))
"""


def _evaluate_child(count: int, workers: int, short: bool = True) -> list:
    """[wall seconds, plans refused, the rows' digest] of stg.evaluate in a fresh child."""
    code = _EVALUATE.format(folder=str(Path(__file__).parent), count=count, workers=workers, short=short)
    return json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def evaluate_workers(count: int, workers: int, pairs: int) -> None:
    """stg.evaluate's wall time over `count` plans in one process and with `workers`, each run
    in a fresh child (no cache carried over), the two alternating `pairs` times."""
    walls: dict[int, list[float]] = {1: [], workers: []}
    for _ in range(pairs):
        for n in walls:
            walls[n].append(_evaluate_child(count, n)[0])
    one, many = statistics.median(walls[1]), statistics.median(walls[workers])
    print(f"  one process {one:.2f} s ({count / one:.0f} plans/s), {workers} workers {many:.2f} s "
          f"({count / many:.0f} plans/s): {one / many:.2f}x (medians of {pairs} alternating pairs)")


def evaluate_short(count: int, pairs: int) -> None:
    """stg.evaluate's wall time over `count` plans on models' short forms (stg/short.py) and on
    the full passes, each in a fresh child, alternating `pairs` times; the rows must agree."""
    walls: dict[bool, list[float]] = {True: [], False: []}
    digests = set()
    for _ in range(pairs):
        for short in walls:
            seconds, _, digest = _evaluate_child(count, 1, short)
            walls[short].append(seconds)
            digests.add(digest)
    if len(digests) > 1:
        raise SystemExit("the short form's rows differ from the full passes'")
    short, full = statistics.median(walls[True]), statistics.median(walls[False])
    print(f"  short form {short:.2f} s ({count / short:.0f} plans/s), full passes {full:.2f} s ({count / full:.0f} "
          f"plans/s): {short / full:.2f}x the time, the same rows (medians of {pairs} alternating pairs)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", type=int, default=48)
    parser.add_argument("--workers", type=int, default=2, help="workers for section 4")
    parser.add_argument("--pairs", type=int, default=2, help="alternating pairs of section 4")
    args = parser.parse_args()
    fresh_processes()
    print(f"stg.evaluate over {args.plans} llama3-405b plans, one process:")
    evaluate_rate(args.plans)
    print(f"stg.evaluate over {args.plans} plans, fresh processes, one against {args.workers} workers:")
    evaluate_workers(args.plans, args.workers, args.pairs)
    print(f"stg.evaluate over {args.plans} plans, fresh processes, the short form against the full passes:")
    evaluate_short(args.plans, args.pairs)


if __name__ == "__main__":
    main()
