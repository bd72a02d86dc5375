"""Scale benchmark (issue 7): wall time, peak RSS and bytes as the rank count grows.

    python benchmarks/bench_scale.py [--scratch DIR] [--ranks 8192 32768 131072] [--workers 2]

Runs `stg generate` in a child process per point (so each peak RSS is its own):
  - llama3-405b, tp=8, pp=16 (uneven 8x14 + 7x2 blocks), seq 8192, 2 micro-batches per rank,
    with dp chosen to give each rank count; the set is written to --scratch and deleted;
  - the largest point again with --count-only;
  - gpt3-175b at 1,048,576 ranks (tp=8, dp=131072) with --count-only;
and compares stamping throughput with a plain write of the same bytes from Python.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

from child import run_stg as run

SPLIT = ",".join(["8"] * 14 + ["7"] * 2)


def plain_write(folder: Path, files: int, size: int) -> float:
    """Seconds to write `files` files of `size` bytes from one Python buffer."""
    buffer = os.urandom(size)
    start = time.perf_counter()
    for n in range(files):
        with open(folder / f"plain.{n}", "wb") as f:
            f.write(buffer)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scratch", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--ranks", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    args = parser.parse_args()
    print(f"{'ranks':>9} {'wall s':>8} {'peak RSS MB':>12} {'GB':>7} {'MB/s':>7}  mode")
    for ranks in args.ranks:
        dp = ranks // (8 * 16)
        out = Path(tempfile.mkdtemp(dir=args.scratch)) / "set"
        plan = ["llama3-405b", "--tp", "8", "--pp", "16", "--dp", str(dp), "--layers-per-stage", SPLIT,
                "--global-batch", str(2 * dp), "--seq", "8192"]
        wall, rss, _ = run(["generate", *plan, "-o", str(out), "-q", "--workers", str(args.workers)])
        size = sum(p.stat().st_size for p in out.iterdir())
        print(f"{ranks:>9} {wall:>8.1f} {rss:>12.0f} {size / 1e9:>7.2f} {size / 1e6 / wall:>7.0f}  write")
        files = len(list(out.glob("*.et")))
        shutil.rmtree(out.parent)
        if ranks == max(args.ranks):
            wall_c, rss_c, _ = run(["generate", *plan, "-o", str(out), "--count-only"])
            print(f"{ranks:>9} {wall_c:>8.1f} {rss_c:>12.0f} {size / 1e9:>7.2f} {'':>7}  count-only")
            folder = Path(tempfile.mkdtemp(dir=args.scratch))
            plain = plain_write(folder, files, size // files)
            shutil.rmtree(folder)
            print(f"stamping vs plain write of the same {size / 1e9:.2f} GB in {files} files: "
                  f"{wall:.1f} s vs {plain:.1f} s -> ratio {wall / plain:.2f}")
    gpt = ["generate", "gpt3-175b", "--tp", "8", "--dp", "131072", "--global-batch", "131072", "--seq", "2048",
           "-o", str(args.scratch / "unused"), "--count-only"]
    wall, rss, out = run(gpt)
    print(f"{1 << 20:>9} {wall:>8.1f} {rss:>12.0f} {'':>7} {'':>7}  count-only gpt3-175b tp=8 dp=131072")


if __name__ == "__main__":
    main()
