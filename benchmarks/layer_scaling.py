"""How much of stg.evaluate's time grows with the layers: the bench_build.py plans, evaluated
for llama3-405b as published (126 layers) and for the same model cut to fewer layers, side by
side in alternating fresh processes, each plan put down as bench_build.py does (a structure's
first plan, a new unit binding, a new stage cut, a plan whose structure, units and cut were
seen). It measured what a template/instance graph would save (docs/performance.md, "What grows
with the layers"); since stg.evaluate runs both models on their short forms (stg/short.py,
5 blocks each) it measures what still grows with the layers: what a stage cut weighs per block.

    python benchmarks/layer_scaling.py [--layers 18] [--pairs 2]

Only the plans whose pp divides both layer counts are run (126 = 2 * 3^2 * 7: with 18 layers,
pp 1, 2, 3, 6, 9), so both models evaluate the same plans, none refused.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

FULL = 126  # llama3-405b's layers
CATEGORIES = ("first", "units", "cut", "seen")

_CHILD = """
import json, sys, time
sys.path.insert(0, {folder!r})
import stg
from bench_build import plans
from stg import evaluate, load_model
from stg.evaluation import structure_order
from stg.yamlio import read_yaml
from importlib import resources
fields = read_yaml(resources.files("model_zoo") / "models" / "llama3-405b.yaml", "llama3-405b", ValueError)
fields["layers"] = {layers}
model = load_model(fields)
model.graph
chosen = [p for p in plans({count}) if {full} % p["pp"] == 0 and {short} % p["pp"] == 0]
seen, times, refused = set(), {{}}, 0
for plan in sorted(chosen, key=lambda p: structure_order(stg.Plan.from_dict(p))):
    structure, units, pp = structure_order(stg.Plan.from_dict(plan))
    kind = ("seen" if (structure, units, pp) in seen else "first" if structure not in seen
            else "units" if (structure, units) not in seen else "cut")
    seen |= {{structure, (structure, units), (structure, units, pp)}}
    began = time.perf_counter()
    refused += "error" in next(evaluate(model, [plan]))
    times.setdefault(kind, []).append(time.perf_counter() - began)
print(json.dumps([len(chosen), refused, times]))
"""


def run(layers: int, short: int, count: int) -> tuple[int, int, dict[str, list[float]]]:
    """One fresh process: the plans whose pp divides FULL and `short`, on `layers` layers."""
    code = _CHILD.format(folder=str(Path(__file__).parent), layers=layers, count=count, full=FULL, short=short)
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return tuple(json.loads(found.stdout.splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=18, help="the short model's layers")
    parser.add_argument("--plans", type=int, default=1000, help="bench_build.py's plans drawn (before the pp filter)")
    parser.add_argument("--pairs", type=int, default=2, help="alternating pairs of fresh processes")
    args = parser.parse_args()
    runs: dict[int, list] = {FULL: [], args.layers: []}
    for _ in range(args.pairs):
        for layers in (FULL, args.layers):
            runs[layers].append(run(layers, args.layers, args.plans))
    count, refused = runs[FULL][0][0], {layers: found[0][1] for layers, found in runs.items()}
    print(f"{count} llama3-405b plans (pp dividing {FULL} and {args.layers}), refused: {refused}; "
          f"medians of {args.pairs} alternating fresh processes")
    print(f"  {'':8s} {'plans':>6s} {f'{FULL} layers':>12s} {f'{args.layers} layers':>12s} {'ratio':>7s}"
          f" {'per layer':>10s}")
    totals = {}
    for kind in CATEGORIES:
        each = {}
        for layers, found in runs.items():
            each[layers] = statistics.median(sum(times.get(kind, ())) for _, _, times in found)
            totals[layers] = totals.get(layers, 0) + each[layers]
        n = len(runs[FULL][0][2].get(kind, ()))
        if n:
            full, short = each[FULL] / n * 1e3, each[args.layers] / n * 1e3
            print(f"  {kind:8s} {n:6d} {full:9.1f} ms {short:9.1f} ms {full / short:6.2f}x "
                  f"{(full - short) / (FULL - args.layers) * 1e3:7.0f} us")
    print(f"  all: {count / totals[FULL]:.0f} plans/s with {FULL} layers, {count / totals[args.layers]:.0f} with "
          f"{args.layers} ({totals[FULL] / totals[args.layers]:.2f}x the time)")


if __name__ == "__main__":
    main()
