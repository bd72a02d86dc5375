"""Recommendation-model benchmark (issue 5): DLRM-DCNv2 sets as the rank count grows.

    python benchmarks/bench_dlrm.py [--scratch DIR] [--ranks 1024 8192 65536] [--workers 2]

For each rank count and embedding sharding (MLPerf's global batch of 65,536 samples split
over the ranks, rounded up to one sample per rank), `stg generate dlrm-dcnv2` runs in a child
process and writes the set to --scratch, which is deleted afterwards. Prints wall time, peak
RSS, bytes written, rank classes (how many distinct programs were lowered), and the largest
rank's embedding memory and all-to-all bytes per step.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

from child import run_stg

SHARDINGS = {  # name -> extra options (table_row_wise: hosts of 8 ranks)
    "table_wise": [],
    "row_wise": [],
    "auto": [],
    "table_row_wise": ["--local-world-size", "8"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scratch", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--ranks", type=int, nargs="+", default=[1024, 8192, 65536])
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    args = parser.parse_args()
    print(f"{'ranks':>7} {'sharding':>15} {'wall s':>7} {'RSS MB':>7} {'GB':>6} {'classes':>7} "
          f"{'emb GiB max':>11} {'A2A MB max':>10}")
    for ranks in args.ranks:
        micro = max(1, 65536 // ranks)
        for sharding, extra in SHARDINGS.items():
            dp = ranks // 8 if extra else ranks
            out = Path(tempfile.mkdtemp(dir=args.scratch)) / "set"
            wall, rss, _ = run_stg(["generate", "dlrm-dcnv2", "--dp", str(dp), *extra, "--micro-batch", str(micro),
                             "--embedding-sharding", sharding, "-o", str(out), "-q", "--workers", str(args.workers)])
            size = sum(p.stat().st_size for p in out.iterdir())
            summary = json.loads((out / "summary.json").read_text())
            classes = summary["rank_classes"]
            emb = max(c["memory"].get("embedding_weights", 0) + c["memory"].get("embedding_optimizer_states", 0)
                      for c in classes)
            a2a = max(c["comm_bytes"].get("ALL_TO_ALL", 0) for c in classes)
            print(f"{ranks:>7} {sharding:>15} {wall:>7.1f} {rss:>7.0f} {size / 1e9:>6.2f} {len(classes):>7} "
                  f"{emb / 2**30:>11.2f} {a2a / 1e6:>10.1f}", flush=True)
            shutil.rmtree(out.parent)


if __name__ == "__main__":
    main()
