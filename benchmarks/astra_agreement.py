"""stg's estimate against ASTRA-sim's analytical backend on 20 plans of <= 64 ranks (issue 13).

    STG_ASTRA_SIM=/path/to/AstraSim_Analytical_Congestion_Unaware python benchmarks/astra_agreement.py [--keep DIR]

Each plan is built (stg.api.build), estimated (stg.explore.cost.estimate, the slice replay that
`stg explore` ranks by) and written (stg.api.generate); the written set is run in ASTRA-sim
with the network and system files that stg.explore.astra derives from the same network
description and device. Printed: per plan both times (ms) and their ratio stg / ASTRA-sim,
then the largest deviation and Spearman's rank correlation of the two columns.

The networks are two-tier switched clusters (4 or 8 GPUs per node) with `hierarchical: true`
(a collective over every rank runs node tier, then fabric tier, as ASTRA-sim's
multi-dimensional collectives), `all_to_all: ring` (ASTRA-sim's ring all-to-all) and
`reduction_gbps` = the device's memory bandwidth (ASTRA-sim's local-mem-bw charge on every
reducing step; --free-reduction leaves it out, stg's default), or --network NAME for all. Every
plan's groups are aligned with the tiers (the node size is a product of the innermost mesh
axes), so that ASTRA-sim's per-hop routing (the lowest dimension in which two ranks differ)
charges the tier stg charges; a plan where that fails is flagged (stg.explore.astra.misaligned).
The target: every ratio within 0.9-1.1 and Spearman >= 0.9.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from stg.api import build, generate
from stg.device import device_spec
from stg.explore.astra import find_binary, misaligned, simulate
from stg.explore.cost import estimate
from stg.explore.network import load_network, network_from_dict
from stg.explore.search import label
from stg.plan import Plan


def two_tier(node: int, reduction_gbps: float | None = None) -> dict:
    return {"name": f"switched-{node}", "hierarchical": True, "all_to_all": "ring", "reduction_gbps": reduction_gbps,
            "tiers": [
        {"name": "node", "size": node, "topology": "switch", "bandwidth_gbps": 200, "latency_us": 2, "efficiency": 0.9},
        {"name": "fabric", "size": None, "topology": "switch", "bandwidth_gbps": 25, "latency_us": 5, "efficiency": 0.9}]}


LLAMA = dict(name="small-llama", family="llama", layers=8, hidden=1024, ffn=2816, heads=16, kv_heads=8, vocab=8192)
MIXTRAL = dict(name="small-mixtral", family="mixtral", layers=4, hidden=1024, ffn=2048, heads=16, kv_heads=4,
               vocab=8192, experts=8, top_k=2, moe_ffn=1024)
S = dict(seq=1024)

# (model, plan, GPUs per node): the node size is the product of the innermost mesh axes
# (mesh order pp, dp, ep, cp, tp; tp fastest)
CASES = [
    (LLAMA, Plan(dp=16, zero=1, global_batch=32, **S), 4),
    (LLAMA, Plan(dp=4, pp=4, global_batch=16, micro_batch=1, **S), 4),
    (LLAMA, Plan(tp=4, sp=False, dp=4, global_batch=16, **S), 4),
    (LLAMA, Plan(tp=4, sp=True, dp=4, global_batch=16, **S), 4),
    (LLAMA, Plan(tp=4, pp=4, schedule="gpipe", global_batch=8, **S), 4),
    (LLAMA, Plan(tp=4, pp=2, dp=2, schedule="interleaved", vpp=2, global_batch=8, **S), 4),
    (LLAMA, Plan(tp=4, pp=4, schedule="zb-h1", global_batch=8, **S), 4),
    (LLAMA, Plan(tp=4, dp=4, zero=3, global_batch=16, **S), 4),
    (LLAMA, Plan(dp=4, pp=4, zero=1, recompute="full", global_batch=16, **S), 4),
    (LLAMA, Plan(cp=4, dp=4, global_batch=8, seq=2048), 4),
    (LLAMA, Plan(tp=2, cp=2, pp=4, global_batch=8, seq=2048), 4),
    (MIXTRAL, Plan(dp=16, ep=4, global_batch=32, **S), 4),
    (MIXTRAL, Plan(dp=4, ep=4, pp=4, global_batch=16, **S), 4),
    (MIXTRAL, Plan(tp=4, dp=4, ep=4, global_batch=16, **S), 4),
    (MIXTRAL, Plan(dp=32, ep=8, global_batch=64, **S), 8),
    (MIXTRAL, Plan(tp=2, dp=4, ep=4, pp=2, global_batch=16, **S), 8),
    (LLAMA, Plan(tp=8, dp=4, global_batch=16, **S), 8),
    (LLAMA, Plan(tp=8, pp=8, global_batch=16, **S), 8),
    (LLAMA, Plan(dp=8, pp=8, zero=1, global_batch=32, **S), 8),
    (LLAMA, Plan(tp=4, cp=2, pp=4, schedule="interleaved", vpp=2, global_batch=8, seq=2048), 8),
]


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rho (average ranks for ties): Pearson's correlation of the ranks."""
    def ranks(values):
        order = sorted(range(len(values)), key=values.__getitem__)
        r = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--astra-sim", help="the ASTRA-sim binary [default: $STG_ASTRA_SIM]")
    parser.add_argument("--keep", type=Path, help="write the sets here (default: a temporary folder)")
    parser.add_argument("--only", type=int, nargs="*", help="case numbers (1-based) to run")
    parser.add_argument("--network", help="one network (name or YAML) for every case instead of the two-tier ones")
    parser.add_argument("--free-reduction", action="store_true",
                        help="stg's default network model: reductions free (ASTRA-sim charges them at local-mem-bw)")
    args = parser.parse_args()
    binary = find_binary(args.astra_sim)
    out = args.keep or Path(tempfile.mkdtemp(prefix="stg-astra-agreement-"))
    rows = []
    print(f"{'#':>2} {'model':<13} {'plan':<40} {'net':<11} {'ranks':>5} {'stg ms':>9} {'ASTRA ms':>9} {'ratio':>6}")
    for i, (model, plan, node) in enumerate(CASES, 1):
        if args.only and i not in args.only:
            continue
        memory_gbps = device_spec(plan.device).memory_tbps * 1e3
        network = load_network(args.network) if args.network else \
            network_from_dict(two_tier(node, None if args.free_reduction else memory_gbps))
        if args.network and not args.free_reduction:
            network = replace(network, reduction_gbps=memory_gbps)
        workload = build(model, plan)
        ours = estimate(workload, network).step_us
        folder = out / f"{i:02d}-{label(plan)}"
        generate(model, plan, folder)
        world = workload.mesh.size
        groups = {int(k): v for k, v in json.loads((folder / "workload.json").read_text()).items()}
        odd = misaligned(network, groups, world)
        run = simulate(binary, folder, network, memory_gbps, timeout_s=900)
        problem = run.problem()
        theirs = run.time_us if problem is None else float("nan")
        flag = (f"  misaligned groups {odd}" if odd else "") + (f"  {problem}" if problem else "")
        print(f"{i:>2} {model['name']:<13} {label(plan):<40} {network.name:<11} {world:>5} {ours / 1e3:9.3f} "
              f"{theirs / 1e3:9.3f} {ours / theirs:6.3f}{flag}", flush=True)
        rows.append((ours, theirs))
    done = [(a, b) for a, b in rows if b == b]
    if len(done) >= 2:
        worst = max(abs(a / b - 1) for a, b in done)
        rho = spearman([a for a, _ in done], [b for _, b in done])
        within = sum(abs(a / b - 1) <= 0.10 for a, b in done)
        print(f"{len(done)} of {len(rows)} simulated; {within} within 10 %; largest deviation {worst:.1%}; "
              f"Spearman {rho:.3f}")
    print(f"sets in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
