"""Reading collectives and FLOPs off a built workload, per block and phase."""

from collections import Counter

from stg.graph import OpKind
from stg.lower import Evaluator


def block_collectives(workload, layer: int) -> Counter:
    """(phase letter, collective name, comm bytes) -> count, for one block's ops."""
    evaluate = Evaluator(workload.bindings)
    found = Counter()
    for op in workload.sharded.graph.ops:
        if op.kind is OpKind.COLLECTIVE and op.layer == layer:
            found[(op.phase.value, op.attrs["collective"].name, evaluate(op.bytes))] += 1
    return found


def op_flops(workload) -> Counter:
    """FLOPs per op of one rank (micro-batches and re-runs summed under the op's name)."""
    flops = Counter()
    for node in workload.programs[0].nodes:
        if node.type.name == "COMP_NODE":
            flops[node.name.split(" ", 1)[1]] += node.flops
    return flops
