"""Time every stage of `generate` as the data-parallel degree grows.

    python benchmarks/bench_generate.py --model llama2-7b --dp 8 64 512 4096 --seq 2048
    python benchmarks/bench_generate.py --model llama3-70b --dp 8 --tp 8 --cp 2 --zero 1 --seq 8192

Prints, per run: build time (graph, autodiff, sharding, lowering of the rank class), write
time, ranks per second, MB written per second, bytes per rank and the peak RSS. The set is
written under --scratch and deleted afterwards.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import tempfile
import time
from pathlib import Path

from stg import Plan, build, load_model
from stg.emit import write_trace_set


def run(model_name: str, dp: int, seq: int, microbatches: int, scratch: Path, **parallel) -> dict:
    model = load_model(model_name)
    model.graph  # parse and build the forward graph outside the timed region: it is per model
    plan = Plan(dp=dp, micro_batch=1, global_batch=dp * microbatches, seq=seq, **parallel)
    start = time.perf_counter()
    workload = build(model, plan)
    built = time.perf_counter()
    out = Path(tempfile.mkdtemp(dir=scratch)) / "set"
    write_trace_set(out, workload, workload.summary())
    written = time.perf_counter()
    size = sum(p.stat().st_size for p in out.iterdir())
    shutil.rmtree(out.parent)
    return {
        "ranks": plan.world_size,
        "nodes/rank": max(len(p.nodes) for p in workload.programs),
        "build s": built - start,
        "write s": written - built,
        "ranks/s": plan.world_size / (written - built),
        "MB/s": size / 1e6 / (written - built),
        "MB/rank": size / 1e6 / plan.world_size,
        "peak RSS MB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama2-7b")
    parser.add_argument("--dp", type=int, nargs="+", default=[8, 64, 512])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--microbatches", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--zero", type=int, default=0)
    parser.add_argument("--recompute", default="none")
    parser.add_argument("--scratch", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()
    parallel = dict(tp=args.tp, cp=args.cp, zero=args.zero, recompute=args.recompute)
    rows = [run(args.model, dp, args.seq, args.microbatches, args.scratch, **parallel) for dp in args.dp]
    print(f"model {args.model}, seq {args.seq}, {args.microbatches} micro-batch(es) per rank, {parallel}")
    header = list(rows[0])
    print(" | ".join(f"{h:>11}" for h in header))
    for row in rows:
        print(" | ".join(f"{v:>11.2f}" if isinstance(v, float) else f"{v:>11}" for v in row.values()))


if __name__ == "__main__":
    main()
