"""Does explore time a plan as its written programs replay? A sweep over zoo plans.

    python benchmarks/timing_sweep.py [--network NAME] [--sample N]

Explore lowers a plan for timing only (stg.api.build(timing=True): repeated actions, a stage's
actions and step moved from an alike stage, a degree of 1 timed on the structure of degrees
above 1), and the written set comes from the full lowering (stg.api.build()). For every plan
of the sweep both are built and their pipeline slices replayed (stg/explore/cost.py,
slice_timings), free and on the network: the timings must be equal. Prints each plan that
differs and the count; exit 1 if any does.

The sweep: llama3-8b and mixtral-8x7b (ep 1, 2, 4) over tp 1/2, pp 1/2/4, cp 1/2, 1F1B /
ZB-H1 / interleaved, ZeRO 0/1/3, no or full recomputation, dp 4, two micro-batches per
stage, seq 512 per cp rank; and every `--sample`-th such plan of gpt3-175b and deepseek-v3
(ep 4), stages cut by `auto`: 720 plans, 6 minutes on the 2-core machine (2026-12-03: none
differ; before 601b71c, mixtral-8x7b dp4 tp2 ep4 pp1 ZeRO-1 was timed 1.75 % short). The tests
hold the digest matrix's strategies (tests/test_evaluate.py); run this after touching the
timing lowering (stg/lower.py, stg/repeats.py, stg/shapes.py).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

from stg.api import build
from stg.errors import StgError
from stg.explore.cost import slice_timings
from stg.explore.network import load_network

MODELS = {"llama3-8b": (1,), "mixtral-8x7b": (1, 2, 4), "gpt3-175b": (1,), "deepseek-v3": (4,)}
SAMPLED = ("gpt3-175b", "deepseek-v3")  # large: every --sample-th plan


def plans(sample: int):
    """(model, plan) of the sweep."""
    for model, eps in MODELS.items():
        grid = itertools.product((1, 2), (1, 2, 4), (1, 2), ("1f1b", "zb-h1", "interleaved"), (0, 1, 3),
                                 ("none", "full"), eps)
        for n, (tp, pp, cp, schedule, zero, recompute, ep) in enumerate(grid):
            if (pp == 1 and schedule != "1f1b") or (model in SAMPLED and n % sample):
                continue
            plan = dict(dp=4, tp=tp, pp=pp, cp=cp, ep=ep, zero=zero, recompute=recompute, seq=512 * cp,
                        global_batch=4 * 2 * max(pp, 2), schedule=schedule, vpp=2 if schedule == "interleaved" else 1)
            if model in SAMPLED:
                plan["layers_per_stage"] = "auto"
            yield model, plan


def main(network_name: str, sample: int) -> int:
    network = load_network(network_name)
    checked, differ, started = 0, 0, time.perf_counter()
    for model, plan in plans(sample):
        try:
            timed, written = build(model, plan, nodes=False, timing=True), build(model, plan)
        except StgError:
            continue  # a plan the model refuses (a degree that does not divide, ...)
        checked += 1
        for variant in range(written.variants):
            mine, theirs = slice_timings(timed, network, variant), slice_timings(written, network, variant)
            if mine != theirs:
                differ += 1
                off = abs(mine[1].makespan_us - theirs[1].makespan_us) / theirs[1].makespan_us
                print(f"DIFFERS {model} {plan} variant {variant}: free {'equal' if mine[0] == theirs[0] else 'differs'},"
                      f" on {network_name} {off:.4%} apart", flush=True)
    print(f"{checked} plans timed and written, {differ} differ ({time.perf_counter() - started:.0f} s)")
    return 1 if differ else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--network", default="dgx-h100-superpod")
    parser.add_argument("--sample", type=int, default=7, help="check every N-th plan of the large models")
    args = parser.parse_args()
    sys.exit(main(args.network, args.sample))
