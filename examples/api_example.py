"""The Python API end to end: load a model, make a plan, write and validate a trace set.

    python examples/api_example.py [OUT]
"""

import sys
from pathlib import Path

from stg import Plan, build, generate, load_model
from stg.chakra.validate import validate


def main(out: Path) -> None:
    model = load_model("llama3-8b")  # a zoo name, a YAML path, or a dict of sizes
    plan = Plan(dp=4, micro_batch=1, global_batch=8, seq=2048)

    # build() runs every pass short of writing: look at what one rank will do
    workload = build(model, plan)
    print(f"{model.name}: {model.params:,} parameters on {plan.world_size} ranks")
    print("layout of one MLP activation:", workload.sharded.describe("layers.0.mlp.up"))
    print("layout of its weight gradient:", workload.sharded.describe("layers.0.mlp.up.weight.grad"))

    summary = generate(model, plan, out=out)
    per_rank = summary["rank_classes"][0]
    print(f"per rank: {per_rank['flops'] / 1e12:.1f} TFLOP, "
          f"{per_rank['comm_bytes']['ALL_REDUCE'] / 2**30:.2f} GiB all-reduced in "
          f"{per_rank['comm_count']['ALL_REDUCE']} buckets")

    problems = validate(out)
    print("valid" if not problems else "\n".join(map(str, problems)))
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "out/api-example"))
