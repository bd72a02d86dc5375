"""A 2-trillion-parameter MoE on 16,384 ranks (issue 6): generate it, report time and the
per-rank memory of each pipeline stage.

    python benchmarks/bench_moe.py [--scratch DIR] [--keep]

moe-2t (model_zoo/models/moe-2t.yaml): pp=8 (8x5 + 7x3 blocks), dp=256 (of them ep=64:
4 expert-data-parallel replicas) (8 of its 512 experts per rank), tp=8, ZeRO-1, seq 4096, 2 micro-batches per rank.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from child import run_stg

PLAN = ["moe-2t", "--pp", "8", "--layers-per-stage", "8,8,8,8,8,7,7,7", "--dp", "256", "--ep", "64", "--tp", "8",
        "--zero", "1", "--seq", "4096", "--global-batch", "512"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scratch", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--keep", action="store_true", help="Keep the set (default: delete it).")
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(dir=args.scratch)) / "moe-2t"
    wall, rss, _ = run_stg(["generate", *PLAN, "-o", str(out), "-q"])
    size = sum(p.stat().st_size for p in out.iterdir())
    summary = json.loads((out / "summary.json").read_text())
    print(f"{summary['model']['name']}: {summary['model']['params']:,} parameters on {summary['world_size']:,} ranks")
    print(f"generated in {wall:.1f} s, peak RSS {rss:.0f} MB, {size / 1e9:.2f} GB")
    print(f"{'stage':>5} {'weights':>9} {'grads':>9} {'states':>9} {'activ.':>9} {'peak GiB':>9} {'A2A GiB':>8}")
    for cls in summary["rank_classes"]:
        mem = {k: v / 2**30 for k, v in cls["memory"].items()}
        a2a = cls["comm_bytes"].get("ALL_TO_ALL", 0) / 2**30
        print(f"{cls['class']:>5} {mem['weights']:>9.2f} {mem['gradients']:>9.2f} {mem['optimizer_states']:>9.2f} "
              f"{mem['activations']:>9.2f} {mem['peak']:>9.2f} {a2a:>8.2f}")
    if not args.keep:
        shutil.rmtree(out.parent)


if __name__ == "__main__":
    main()
