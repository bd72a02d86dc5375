"""Wall time of stg against STAGE (astra-sim/stage) on STAGE's dp8 tp4 pp4 example, side by side.

STAGE's README example "Generate with DP=8, TP=4, PP=4, no FSDP" (128 ranks) with its default
model (80 blocks, dmodel 8192, dff 28672, 64 heads, 8 kv heads, vocabulary 32000: Llama 2 70B's
shape), batch 64 and seq 1024. Its --micro_batch defaults to the batch, so one micro-batch of 64
sequences split over dp 8: 8 sequences per rank, which is stg's --micro-batch 8 --global-batch 64.
Each command runs in a fresh child process, the two in turn (STAGE, stg, STAGE, stg, ...), and
writes its 128 .et files under a scratch folder that is deleted afterwards. Prints each run's
wall seconds, min and median of each, the ratio STAGE/stg of the medians and pair by pair, and
what each wrote (files, bytes).

STAGE is not installed with stg: check it out (github.com/astra-sim/stage) and give it a Python
that has its requirements.txt (sympy numpy pandas graphviz tqdm protobuf):

    python benchmarks/bench_stage.py --stage ~/stage --stage-python ~/stage-venv/bin/python [--runs 3]
    STAGE_DIR=~/stage STAGE_PYTHON=~/stage-venv/bin/python python benchmarks/bench_stage.py
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from child import compile_bytecode

DP, TP, PP, BATCH, SEQ = 8, 4, 4, 64, 1024


def stage_command(python: str, out: Path) -> list[str]:
    """STAGE's main.py with the README's dp8 tp4 pp4 flags; its model defaults spelled out."""
    return [python, "main.py", "--output_dir", str(out), "--output_name", "workload.%d.et",
            "--dp", str(DP), "--tp", str(TP), "--pp", str(PP), "--sp", "1", "--weight_sharded", "0",
            "--chakra_schema_version", "v0.0.4", "--batch", str(BATCH), "--seq", str(SEQ),
            "--num_stacks", "80", "--dmodel", "8192", "--dff", "28672", "--head", "64", "--kvhead", "8",
            "--dvocal", "32000"]


def stg_command(out: Path, micro_batch: int, workers: int | None) -> list[str]:
    command = [sys.executable, "-m", "stg", "generate", "llama2-70b", "--dp", str(DP), "--tp", str(TP),
               "--pp", str(PP), "--global-batch", str(BATCH), "--micro-batch", str(micro_batch),
               "--seq", str(SEQ), "-q", "-o", str(out)]
    return command + (["--workers", str(workers)] if workers else [])


def timed(command: list[str], cwd: Path | None, out: Path) -> tuple[float, int, int]:
    """(wall seconds, .et files, bytes written) of one child process; exits naming it if it fails."""
    start = time.perf_counter()
    child = subprocess.run(command, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wall = time.perf_counter() - start
    if child.returncode:
        raise SystemExit(f"{' '.join(command)} failed ({child.returncode}): {child.stderr.decode()[-2000:]}")
    files = [p for p in out.iterdir() if p.is_file()]
    return wall, sum(p.suffix == ".et" for p in files), sum(p.stat().st_size for p in files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", type=Path, default=os.environ.get("STAGE_DIR"),
                        help="STAGE checkout (holds main.py) [env STAGE_DIR]")
    parser.add_argument("--stage-python", default=os.environ.get("STAGE_PYTHON", sys.executable),
                        help="Python with STAGE's requirements [env STAGE_PYTHON; default this one]")
    parser.add_argument("--runs", type=int, default=3, help="runs of each command")
    parser.add_argument("--micro-batch", type=int, default=8,
                        help="stg's sequences per rank per micro-batch (8: STAGE's one micro-batch)")
    parser.add_argument("--workers", type=int, default=None, help="stg's --workers [default: its own]")
    parser.add_argument("--scratch", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()
    if args.stage is None:
        raise SystemExit("bench_stage: STAGE not given: pass --stage DIR or set STAGE_DIR "
                         "(a checkout of astra-sim/stage)")
    stage = args.stage.expanduser().resolve()
    if not (stage / "main.py").is_file() or not (stage / "symbolic_tensor_graph").is_dir():
        raise SystemExit(f"bench_stage: STAGE not found: {stage} holds no main.py and symbolic_tensor_graph/")
    if shutil.which(args.stage_python) is None and not Path(args.stage_python).is_file():
        raise SystemExit(f"bench_stage: STAGE's Python not found: {args.stage_python}")

    # both byte-compiled first, each by its own Python (see child.compile_bytecode)
    compile_bytecode()
    subprocess.run([args.stage_python, "-m", "compileall", "-q", str(stage)], stdout=subprocess.DEVNULL, check=True)
    scratch = Path(tempfile.mkdtemp(prefix="bench_stage.", dir=args.scratch))
    walls: dict[str, list[float]] = {"STAGE": [], "stg": []}
    written: dict[str, tuple[int, int]] = {}
    print(f"dp{DP} tp{TP} pp{PP} ({DP * TP * PP} ranks), batch {BATCH}, seq {SEQ}; "
          f"stg llama2-70b --micro-batch {args.micro_batch}")
    print(f"  STAGE (in {stage}): {' '.join(stage_command(args.stage_python, scratch / 'STAGE.N'))}")
    print(f"  stg: {' '.join(stg_command(scratch / 'stg.N', args.micro_batch, args.workers))}")
    try:
        for run in range(args.runs):
            for name in ("STAGE", "stg"):
                out = scratch / f"{name}.{run}"  # STAGE and stg each create it
                if name == "STAGE":
                    wall, files, size = timed(stage_command(args.stage_python, out), stage, out)
                else:
                    wall, files, size = timed(stg_command(out, args.micro_batch, args.workers), None, out)
                shutil.rmtree(out)
                walls[name].append(wall)
                written[name] = (files, size)
                print(f"  run {run + 1} {name:5s} {wall:8.2f} s")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    for name, times in walls.items():
        files, size = written[name]
        print(f"{name:5s} min {min(times):8.2f} s  median {statistics.median(times):8.2f} s  "
              f"({files} .et files, {size / 1e6:.1f} MB in all)")
    pairs = [a / b for a, b in zip(walls["STAGE"], walls["stg"])]
    print(f"STAGE/stg: {statistics.median(walls['STAGE']) / statistics.median(walls['stg']):.1f}x (medians); "
          f"pair by pair {', '.join(f'{r:.1f}' for r in pairs)}")


if __name__ == "__main__":
    main()
