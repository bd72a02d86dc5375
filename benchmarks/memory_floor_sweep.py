"""Is the memory floor a floor? A sweep over explore's spaces (stg/api.py, _memory_floor).

    python benchmarks/memory_floor_sweep.py [--every N]

Before a structure's symbolic passes, build bounds a plan's largest peak per rank from below
and refuses a plan over the device by that bound alone. A bound above the real peak would drop
a plan that fits. For every `--every`-th plan of the default explore spaces (ZeRO 0-3 and every
recomputation added) of llama3-8b and llama3-70b and mixtral-8x7b on 64 GPUs and
gpt3-175b on 256, the floor is computed with no passes known and compared with the peak the
built plan reports: prints per model how many, the largest floor / peak, and every plan
whose floor is above its peak; exit 1 if any is.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter

import stg.api
from model_zoo import load_model
from stg.errors import StgError
from stg.explore import Cluster, Job, Space
from stg.explore.space import plans, resolve

SPACES = (("llama3-8b", 64, Job(global_batch=512, seq=4096)), ("llama3-70b", 64, Job(global_batch=256, seq=4096)),
          ("mixtral-8x7b", 64, Job(global_batch=256, seq=4096)), ("gpt3-175b", 256, Job(global_batch=512, seq=2048)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=int, default=3, help="take every N-th plan of each space")
    args = parser.parse_args()
    floors: list[int] = []
    floor_of = stg.api._memory_floor
    stg.api._memory_floor = lambda *a: floors.append(floor_of(*a)) or floors[-1]
    stg.api.passes_cached = lambda structure: False  # the floor of every plan, not only a structure's first
    over = 0
    for name, gpus, job in SPACES:
        model, cluster, dropped = load_model(name), Cluster(gpus=gpus), Counter()
        space = resolve(Space(zero=(0, 1, 2, 3), recompute=("none", "selective", "full")), cluster, model.layers,
                        getattr(model.config, "experts", None))
        count, worst = 0, 0.0
        for plan in list(plans(space, cluster, job, dropped, model.layers))[::args.every]:
            floors.clear()
            try:
                peak = max(m.peak for m in stg.api.build(model, plan, memory_limit=2**62, nodes=False).memory)
            except StgError:
                continue
            for floor in filter(None, floors):
                count, worst = count + 1, max(worst, floor / peak)
                if floor > peak:
                    over += 1
                    print(f"  {name} {plan.to_dict()}: floor {floor} above the peak {peak}")
        print(f"{name}: {count} plans, floor / peak at most {worst:.3f}", flush=True)
    print(f"{over} floors above their peak")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
