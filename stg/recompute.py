"""Activation recomputation: re-run forward ops before the backward instead of saving them.

A training-graph pass (before sharding, so a re-run's collectives, e.g. ZeRO-3 parameter
gathers and tensor-parallel reductions, are derived like any others). For each repeated
block it copies the chosen forward ops, renamed `<name>.recompute`, right before the block's
first backward op, and points that block's backward ops at the copies. What the backward
then reads of the forward is what is saved (stg/memory.py counts it).

  full:      every op of the block: only the block's input is kept (Korthikanti et al.
             2022, "full activation recomputation": 2sbh bytes per layer).
  selective: only the attention core (ops tagged `attention_core`: scores, softmax,
             dropout, context), whose saved tensors grow with s^2 (their section 5).
"""

from __future__ import annotations

from stg.graph import Graph, Op, Phase
from stg.plan import Recompute

SUFFIX = ".recompute"


def _selected(op: Op, mode: Recompute) -> bool:
    if op.phase is not Phase.FORWARD or op.layer == 0:
        return False
    return mode is Recompute.FULL or op.attrs.get("attention_core", False)


def recompute(graph: Graph, mode: Recompute, last_block: int) -> Graph:
    """`graph` with the selected forward ops of blocks 1..last_block re-run in the backward."""
    if mode is Recompute.NONE:
        return graph
    chosen: dict[int, list[Op]] = {}
    for op in graph.ops:
        if _selected(op, mode) and op.layer <= last_block:
            chosen.setdefault(op.layer, []).append(op)
    # What leaves a re-run region for a forward op outside it is kept, as torch.utils.checkpoint
    # keeps a region's output (the next op saves it); the backward reads re-run copies of the rest.
    inside = {op.name for ops in chosen.values() for op in ops}
    kept = {name for op in graph.ops if op.phase is Phase.FORWARD and op.name not in inside
            for name in op.inputs}
    renamed = {layer: {out: out + SUFFIX for op in ops for out in op.outputs if out not in kept}
               for layer, ops in chosen.items()}
    tensors = dict(graph.tensors)
    for ops in chosen.values():
        for op in ops:
            for out in op.outputs:
                tensors[out + SUFFIX] = graph.tensors[out].renamed(out + SUFFIX)
    ops: list[Op] = []
    placed: set[int] = set()
    for op in graph.ops:
        if op.phase in (Phase.BACKWARD_INPUT, Phase.BACKWARD_WEIGHT) and op.layer in chosen:
            names = renamed[op.layer]
            if op.layer not in placed:
                placed.add(op.layer)
                for fwd in chosen[op.layer]:
                    ops.append(fwd.changed(
                        name=fwd.name + SUFFIX, phase=Phase.BACKWARD_INPUT,
                        inputs=tuple(names.get(i, i) for i in fwd.inputs),
                        outputs=tuple(names.get(o, o + SUFFIX) for o in fwd.outputs),
                        attrs={**fwd.attrs, "recompute": True},
                    ))
            inputs = tuple(names.get(i, i) for i in op.inputs)
            if inputs != op.inputs:
                op = op.changed(inputs=inputs)
        ops.append(op)
    result = Graph(tensors, tuple(ops))
    result.verify()
    return result
