"""Cost of the pictures: timeline JSON bytes per node, and the time of `stg timeline`,
`stg plot` and `stg report` on a generated set.

    python benchmarks/bench_view.py --model llama3-8b --dp 2 --tp 8 --pp 4 --seq 4096 --microbatches 8

Generates the set under --scratch (deleted afterwards), then prints per step: seconds, peak
RSS so far, and for the timeline the bytes, nodes and bytes per node of the shown ranks
(default: one per rank class) and of all ranks.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import tempfile
import time
from pathlib import Path

from stg import Plan, generate
from stg.view.plots import save_plot
from stg.view.report import write_report
from stg.view.timeline import write_timeline


def timed(label: str, fn) -> object:
    start = time.perf_counter()
    result = fn()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{label:<40} {time.perf_counter() - start:7.2f} s   peak RSS {rss:,.0f} MB")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b")
    for axis in ("dp", "tp", "pp"):
        parser.add_argument(f"--{axis}", type=int, default=1)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--scratch", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()
    plan = Plan(dp=args.dp, tp=args.tp, pp=args.pp, schedule=args.schedule, seq=args.seq,
                global_batch=args.dp * args.microbatches)
    work = Path(tempfile.mkdtemp(dir=args.scratch))
    try:
        out = work / "set"
        timed(f"generate ({plan.world_size} ranks)", lambda: generate(args.model, plan, out))
        for label, ranks in (("representatives", None), ("all ranks", list(range(plan.world_size)))):
            path = work / "timeline.json"
            made = timed(f"timeline, {label}", lambda: write_timeline(out, path, comm="alpha-beta", ranks=ranks))
            nodes = sum(len(made.slices[r]) for r in made.ranks)
            size = path.stat().st_size
            print(f"  {len(made.ranks)} ranks, {nodes:,} nodes, {size / 1e6:,.1f} MB, {size / nodes:,.0f} B per node")
        for kind in ("memory", "gantt", "comm"):
            timed(f"plot {kind}", lambda: save_plot(out, kind, work / f"{kind}.svg"))
        timed("report", lambda: write_report(out, work / "report.html"))
        print(f"  report {(work / 'report.html').stat().st_size / 1e3:,.0f} kB")
    finally:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
