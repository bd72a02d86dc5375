"""Scale of `stg serve`: a 1,000-request trace on llama3-70b, tp 8 x 8 replicas (64 ranks), and
RSS over a growing number of decode iterations.

    python benchmarks/bench_serve.py requests --requests 1000 --rate 20
    python benchmarks/bench_serve.py decode --model llama3-8b --steps 1000 10000
    python benchmarks/bench_serve.py disagg --requests 200 --profile code --rate 20

disagg: 2 prefill instances of tp 8 and 2 decode instances of tp 4 x pp 2 (32 ranks), the
KV caches moved between the two layouts (such sets are built in memory, class by class).

decode reports the peak RSS of each run and the growth from the fewest to the most steps,
against --flat-mb (10): the per-iteration records go to iterations.jsonl as they are made
and the steps are built on demand, so the memory should not grow with the iterations.

The request trace is synthetic, in the Azure schema, seeded: Poisson arrivals at --rate per
second, prompt and output lengths log-normal around the Azure 2023 traces' means (--profile
conversation: ContextTokens ~1,155, GeneratedTokens ~211; code: ~2,048 and ~28; Patel et al.,
Splitwise, ISCA 2024). A set holds every iteration on every rank: its size, and so the time to
write it, grows with the iterations, which a light load multiplies (one small batch each). Each run is
a child process (its own peak RSS); the set is written under --scratch and deleted.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import random
import shutil
import tempfile
from pathlib import Path

from child import run_stg


PROFILES = {  # mean ContextTokens, GeneratedTokens of the Azure 2023 traces (Splitwise, Table 2)
    "conversation": (1155, 211),
    "code": (2048, 28),
}


def azure_like(path: Path, count: int, rate: float, profile: str = "conversation", seed: int = 0) -> None:
    rng = random.Random(seed)
    mean_prompt, mean_output = PROFILES[profile]
    t = 0.0
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["TIMESTAMP", "ContextTokens", "GeneratedTokens"])
        for _ in range(count):
            t += rng.expovariate(rate)
            prompt = max(1, min(8000, int(rng.lognormvariate(math.log(mean_prompt) - 0.5, 1.0))))
            output = max(1, min(2000, int(rng.lognormvariate(math.log(mean_output) - 0.5, 1.0))))
            out.writerow([f"{t:.6f}", prompt, output])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["requests", "decode", "disagg"])
    parser.add_argument("--model", default="llama3-70b")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--dp", type=int, default=8)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=20.0, help="arrivals per second (a large rate: a burst)")
    parser.add_argument("--profile", choices=sorted(PROFILES), default="conversation")
    parser.add_argument("--batch", type=int, default=16, help="decode: requests per step")
    parser.add_argument("--steps", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--scratch", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--flat-mb", type=float, default=10.0, help="decode: allowed RSS growth over the step counts")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(dir=args.scratch))
    try:
        if args.what == "disagg":
            trace = scratch / "requests.csv"
            azure_like(trace, args.requests, args.rate, args.profile)
            wall, rss, _ = run_stg(["serve", args.model, "-o", str(scratch / "set"), "--requests", str(trace),
                                    "--prefill-instances", "2", "--decode-instances", "2", "--prefill-tp", "8",
                                    "--decode-tp", "4", "--decode-pp", "2", "-q"])
            summary = json.loads((scratch / "set" / "summary.json").read_text())
            size = sum(p.stat().st_size for p in (scratch / "set").iterdir())
            iterations = sum(r["iterations"]["count"] for r in summary["instances"])
            print(f"{args.requests} {args.profile} requests at {args.rate:g}/s, {args.model} disaggregated 2 x tp8 -> "
                  f"2 x tp4 pp2 ({summary['world_size']} ranks): {wall:.1f} s, {rss:.0f} MB peak RSS, "
                  f"{iterations} iterations, {len(summary['kv_transfers'])} KV transfers, {size / 1e9:.2f} GB")
        elif args.what == "requests":
            trace = scratch / "requests.csv"
            azure_like(trace, args.requests, args.rate, args.profile)
            wall, rss, _ = run_stg(["serve", args.model, "-o", str(scratch / "set"), "--requests", str(trace),
                                    "--tp", str(args.tp), "--dp", str(args.dp), "-q"])
            summary = json.loads((scratch / "set" / "summary.json").read_text())
            size = sum(p.stat().st_size for p in (scratch / "set").iterdir())
            iterations = sum(r["iterations"]["count"] for r in summary["replicas"])  # records: iterations.jsonl
            print(f"{args.requests} {args.profile} requests at {args.rate:g}/s, {args.model} tp{args.tp} x {args.dp} replicas: {wall:.1f} s, "
                  f"{rss:.0f} MB peak RSS, {iterations} iterations, {size / 1e9:.2f} GB; "
                  f"throughput {summary['totals']['throughput_tokens_per_s']:,.0f} tokens/s")
        else:
            peaks = {}
            for steps in args.steps:
                wall, rss, _ = run_stg(["serve", args.model, "-o", str(scratch / f"d{steps}"), "--mode", "decode",
                                        "--batch", str(args.batch), "--context", "1024", "--steps", str(steps),
                                        "--tp", str(args.tp), "-q"])
                size = sum(p.stat().st_size for p in (scratch / f"d{steps}").iterdir())
                shutil.rmtree(scratch / f"d{steps}")
                print(f"decode {steps} iterations, {args.model} tp{args.tp}: {wall:.1f} s, {rss:.0f} MB peak RSS, "
                      f"{size / 1e9:.2f} GB")
                peaks[steps] = rss
            low, high = min(peaks), max(peaks)
            growth = peaks[high] - peaks[low]
            verdict = "flat" if abs(growth) <= args.flat_mb else "GROWS"
            print(f"RSS from {low} to {high} iterations: {growth:+.0f} MB ({verdict}, limit +-{args.flat_mb:g} MB)")
    finally:
        shutil.rmtree(scratch)


if __name__ == "__main__":
    main()
