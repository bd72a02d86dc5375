"""Build cost of a plan (issue 12, "build once, bind many"), measured side by side.

1. A fresh `stg generate --count-only` process per plan (import included): wall seconds and
   peak RSS, for the issue's three plans.
2. stg.evaluate over PLANS distinct llama3-405b plans (tp, pp, cp, micro-batch, ZeRO,
   recompute, dp varied) in one process, once with the structural cache of the symbolic
   passes (stg/api.py) and the memoised costs, once with both emptied before every plan
   (each plan then pays its own sympy, as before the cache): plans/s and the ratio.

    python benchmarks/bench_build.py [--plans 24]
"""

from __future__ import annotations

import argparse
import itertools
import time

from child import run_stg

COMMANDS = {
    "llama3-405b tp8 pp16 dp1024": ["llama3-405b", "--tp", "8", "--pp", "16", "--dp", "1024", "--layers-per-stage",
                                    "auto", "--global-batch", "2048", "--seq", "8192"],
    "deepseek-v3 tp8 ep64 pp8": ["deepseek-v3", "--tp", "8", "--dp", "64", "--ep", "64", "--pp", "8",
                                 "--layers-per-stage", "auto", "--global-batch", "512", "--seq", "4096"],
    "llama3-8b dp8": ["llama3-8b", "--dp", "8", "--global-batch", "64", "--seq", "4096"],
}


def fresh_processes() -> None:
    print("fresh process, stg generate --count-only:")
    for label, args in COMMANDS.items():
        wall, rss, _ = run_stg(["generate", *args, "--count-only"])
        print(f"  {label:32s} {wall:6.2f} s  {rss:6.0f} MB")


def plans(count: int) -> list[dict]:
    space = itertools.product((8, 4), (2, 6, 9), (1, 2), (1, 2), (0, 1), ("none", "full"))
    chosen = []
    for tp, pp, cp, micro, zero, recompute in space:
        dp = 4 * micro
        chosen.append(dict(tp=tp, pp=pp, cp=cp, dp=dp, micro_batch=micro, zero=zero, recompute=recompute,
                           global_batch=dp * micro * 2, seq=8192))
    return chosen[:count]


def evaluate_rate(count: int) -> None:
    import stg.api
    import stg.builder
    from stg import evaluate, load_model

    model = load_model("llama3-405b")
    model.graph
    rates = {}
    for label, cold in (("cached", False), ("cold (caches emptied per plan)", True)):
        stg.api._CACHE.clear()
        stg.builder._COSTS.clear()
        start = time.perf_counter()
        for plan in plans(count):
            if cold:
                stg.api._CACHE.clear()
                stg.builder._COSTS.clear()
            row = next(evaluate(model, [plan]))
            assert "error" not in row, row
        rates[label] = count / (time.perf_counter() - start)
        print(f"  evaluate, {label:32s} {rates[label]:6.2f} plans/s")
    print(f"  ratio cached / cold: {rates['cached'] / rates['cold (caches emptied per plan)']:.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", type=int, default=24)
    args = parser.parse_args()
    fresh_processes()
    print(f"stg.evaluate over {args.plans} llama3-405b plans, one process:")
    evaluate_rate(args.plans)


if __name__ == "__main__":
    main()
