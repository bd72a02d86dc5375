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

That walk costs more than the passes it would spare, so a template graph has to get its
classes by construction. `window_classes` checks the rule proposed for that (what the sharder
can record per block as it goes): each block by its template and, per name it reads from
outside, the maker's origin and layer distance (a leaf by its role); d, the largest such
distance; two layers alike when the blocks of the layers within d around them are. The script
prints those classes too and whether each lies within one class of the walk.
"""

from __future__ import annotations

import time
from collections import defaultdict
from itertools import groupby

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


def window_classes(sharded: ShardedGraph) -> tuple[list[list[int]], int]:
    """The layers grouped by the rule a sharder could apply as it goes (see above), and d."""
    graph, origins, producer = sharded.graph, sharded.origins, sharded.graph.producer
    blocks, distance = defaultdict(list), 0
    for layer, block in groupby(graph.ops, key=lambda op: op.layer):
        block = list(block)
        made, reads = {out for op in block for out in op.outputs}, []
        for name in (name for op in block for name in op.inputs if name not in made):
            maker = producer.get(name)
            if maker is None:
                reads.append(("leaf", graph.tensors[name].role.value))
            else:
                distance = max(distance, abs(maker.layer - layer))
                reads.append((origins.get(maker.name), maker.layer - layer))
        template = origins.get(block[0].name)
        blocks[layer].append((template and template[0], len(block), tuple(reads)))
    groups = defaultdict(list)
    for layer in sorted(blocks):
        groups[tuple(tuple(blocks.get(layer + k, ())) for k in range(-distance, distance + 1))].append(layer)
    return sorted(groups.values()), distance


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
        windows, distance = window_classes(sharded)
        class_of = {layer: n for n, layers in enumerate(classes) for layer in layers}
        within = all(len({class_of[layer] for layer in layers}) == 1 for layers in windows)
        degrees = " ".join(f"{k}{v}" for k, v in plan.to_dict().items() if k in ("tp", "cp", "ep") and v > 1)
        print(f"{model} {degrees} zero {plan.zero} recompute {plan.recompute.value}: {len(sharded.graph.ops)} ops, "
              f"{len(classes)} classes: {', '.join(map(_ranges, classes))} "
              f"(the walk {walk * 1e3:.0f} ms, memory's index {index * 1e3:.0f} ms); by blocks within {distance} "
              f"layer: {len(windows)} classes: {', '.join(map(_ranges, windows))}, each within one of the walk's: {within}")


if __name__ == "__main__":
    main()
