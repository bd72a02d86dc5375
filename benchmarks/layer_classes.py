"""Which layers of a sharded structure are alike, by their ops and by who reads them: the
measurement behind a template/instance graph (docs/performance.md, "Layer classes").

    python benchmarks/layer_classes.py

Two layers are alike here when their ops, in program order over every phase, have the same
origins (ShardedGraph.origins: the same op of copies of a block), and each output of each op
is read by ops of the same origins at the same layer distance. What a pass reads of a layer
through its ops and their readers -- memory's saved activations, the step's reductions and
their makers, the runs a stage cut deals out -- is then the same for both, so such a pass
could work once per class and shift the answer by the layer (which layers read a weight is
not covered: a model that shares weights across layers needs that too). Prints each
structure's classes (layer ranges with how many layers) and the time of the walk that finds
them, beside the time of memory's index (one of the walks a class would spare).
"""

from __future__ import annotations

import time
from collections import defaultdict

from stg.api import build
from stg.memory import _index
from stg.plan import Plan
from stg.sharding import ShardedGraph


def layer_classes(sharded: ShardedGraph) -> list[list[int]]:
    """The layers of `sharded` grouped by their ops' origins and their outputs' readers."""
    graph, origins = sharded.graph, sharded.origins
    by_layer = defaultdict(list)
    for op in graph.ops:
        by_layer[op.layer].append(op)
    groups = defaultdict(list)
    for layer, ops in by_layer.items():
        shape = tuple(
            (origins.get(op.name), op.phase, tuple(
                tuple(sorted((origins.get(user.name, (user.kind.value, user.phase.value)), user.layer - layer)
                             for user in graph.consumers.get(out, ())))
                for out in op.outputs))
            for op in ops)
        groups[shape].append(layer)
    return sorted(groups.values())


def _ranges(layers: list[int]) -> str:
    return f"{layers[0]}..{layers[-1]} ({len(layers)})" if len(layers) > 2 else str(layers)


PLANS = [
    ("llama3-405b", Plan(dp=16, tp=2, zero=1, micro_batch=1, global_batch=2048, seq=8192, recompute="selective")),
    ("llama3-405b", Plan(dp=16, tp=2, cp=2, zero=3, micro_batch=1, global_batch=2048, seq=8192, recompute="full")),
    ("llama3-405b", Plan(dp=16, tp=2, zero=0, micro_batch=1, global_batch=2048, seq=8192)),
    ("deepseek-v3", Plan(dp=16, tp=2, ep=8, zero=1, micro_batch=1, global_batch=2048, seq=4096)),
]


def main() -> None:
    for model, plan in PLANS:
        sharded = build(model, plan, nodes=False).sharded
        sharded = sharded.base or sharded  # the structure's own graph
        started = time.perf_counter()
        classes = layer_classes(sharded)
        walk = time.perf_counter() - started
        started = time.perf_counter()
        _index.__wrapped__(sharded)
        index = time.perf_counter() - started
        degrees = " ".join(f"{k}{v}" for k, v in plan.to_dict().items() if k in ("tp", "cp", "ep") and v > 1)
        print(f"{model} {degrees} zero {plan.zero} recompute {plan.recompute.value}: {len(sharded.graph.ops)} ops, "
              f"{len(classes)} classes: {', '.join(map(_ranges, classes))} "
              f"(the walk {walk * 1e3:.0f} ms, memory's index {index * 1e3:.0f} ms)")


if __name__ == "__main__":
    main()
