"""Pipeline parallelism: blocks placed on stages; the schedule (stg/schedule.py) orders them.

The model's blocks are split over pp * vpp virtual stages, evenly unless the plan gives
`layers_per_stage` (a list, or `auto`: balanced by compute, see `balanced_split`); the first
virtual stage also holds the embedding (block 0), the last the output layer and loss
(block L + 1). Virtual stage c * pp + r runs on pipeline rank r as
its chunk c (Megatron's interleaving). Edges between stages become send/recv pairs when
the rank classes are lowered (stg/lower.py).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from dataclasses import dataclass
from typing import Sequence

from stg.errors import PlanError
from stg.plan import Plan
from stg.sharding import per_graph


@dataclass(frozen=True)
class StagePlan:
    pp: int
    vpp: int
    first_block: tuple[int, ...]  # per virtual stage: its first block (1-based), then the next's
    # per block, how many blocks of a longer model it stands for (stg/short.py; () -- each one)
    weights: tuple[int, ...] = ()

    def __hash__(self) -> int:
        # a stage cut keys the memos of every pass that reads it, asked per stage and action;
        # the dataclass hash rehashes its tuples each time
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = self.__dict__["_hash"] = hash((self.pp, self.vpp, self.first_block, self.weights))
        return cached

    def __getstate__(self) -> dict:
        # the cached hash stays behind: a hash may differ between processes
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    def weight(self, layer: int) -> int:
        return self.weights[layer] if self.weights else 1

    @property
    def stages(self) -> int:
        return self.pp * self.vpp

    def virtual_stage(self, layer: int) -> int:
        """The virtual stage that runs block `layer` (0: embedding, L + 1: head)."""
        return max(0, bisect.bisect_right(self.first_block, layer) - 1)

    def rank_and_chunk(self, stage: int) -> tuple[int, int]:
        return stage % self.pp, stage // self.pp


    def split(self, layers: int) -> tuple[int, ...]:
        """Blocks per virtual stage (the embedding and head not counted)."""
        starts = (1, *self.first_block[1:], layers + 1)
        return tuple(b - a for a, b in zip(starts, starts[1:]))


def block_weight(stages: StagePlan | None):
    """`stages.weight`, or each block once without a stage plan."""
    return stages.weight if stages is not None else lambda layer: 1


def stage_plan(plan: Plan, layers: int, block_costs: Sequence[int] | None = None) -> StagePlan:
    """`block_costs`: per block 0..L+1 (embedding, blocks, head and loss), what `auto` balances."""
    stages = plan.pp * plan.vpp
    if plan.layers_per_stage == "auto":
        assert block_costs is not None and len(block_costs) == layers + 2
        split = balanced_split(block_costs, stages)
    elif plan.layers_per_stage is not None:
        split = plan.layers_per_stage
        if sum(split) != layers:
            raise PlanError(f"layers_per_stage: {list(split)} sums to {sum(split)}, but the model has {layers} blocks")
    else:
        if layers % stages:
            raise PlanError(
                f"pp*vpp={stages} does not divide layers={layers}; give layers_per_stage for an uneven split "
                "(a list, or auto to balance the stages' compute)"
            )
        split = (layers // stages,) * stages
    first, start = [], 1
    for count in split:
        first.append(start)
        start += count
    first[0] = 0  # the embedding goes with the first stage
    return StagePlan(plan.pp, plan.vpp, tuple(first))


def balanced_split(costs: Sequence[int], stages: int) -> tuple[int, ...]:
    """Blocks per stage, each stage at least one, minimising the costliest stage, where the
    first stage also pays costs[0] (the embedding) and the last costs[-1] (output layer and
    loss): Megatron's accounting of the embedding and loss in the pipeline split, by compute.
    Of the splits with that bottleneck, the one with the fewest blocks on the earliest stages
    (lexicographically least): early stages hold the most micro-batches' activations under
    1F1B. Exact (a binary search on the bottleneck, each suffix's fewest stages counted
    greedily), deterministic, integer arithmetic."""
    return _balanced_split(tuple(costs), stages)


@functools.lru_cache(maxsize=64)  # plans of one model and sequence share it
def _balanced_split(costs: tuple[int, ...], stages: int) -> tuple[int, ...]:
    blocks = costs[1:-1]
    n, embedding, head = len(blocks), costs[0], costs[-1]
    if stages == 1:
        return (n,)
    if n < stages:
        raise PlanError(f"layers_per_stage: auto needs a block per stage, but the model has {n} blocks for "
                        f"{stages} stages")
    prefix = list(itertools.accumulate(blocks, initial=0))
    span = lambda i, j: prefix[j] - prefix[i]  # blocks i..j-1

    def fewest(bound: int) -> list[float]:
        """Per block i, the fewest stages that hold blocks i.. under `bound` (the last also
        paying the head), inf where none do. Greedy is exact: costs are >= 0, so a suffix
        never needs more stages than a longer one, and the first stage takes all it can."""
        need = [math.inf] * (n + 1)
        for i in range(n - 1, -1, -1):
            if span(i, n) + head <= bound:
                need[i] = 1
            else:  # the first stage: blocks i..end-1, as many as fit, leaving one
                end = min(bisect.bisect_right(prefix, prefix[i] + bound) - 1, n - 1)
                need[i] = 1 + need[end] if end > i else math.inf
        return need

    def holds(need: list[float], i: int, count: int) -> bool:
        """Blocks i.. on exactly `count` stages under the bound `need` was counted for: no
        fewer than the fewest, and a block each (a stage split in two costs no more)."""
        return need[i] <= count <= n - i

    def feasible(bound: int) -> bool:
        fits = bisect.bisect_right(prefix, bound - embedding) - 1  # the first stage: blocks 0..fits-1
        first = min(fits, n - stages + 1)
        return first >= 1 and holds(fewest(bound), first, stages - 1)

    # the least bottleneck: the least integer bound under which a split exists (binary search)
    low, high = max(blocks), span(0, n) + embedding + head
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if feasible(middle) else (middle + 1, high)
    bottleneck, need = low, fewest(low)
    # of the splits under it, the lexicographically least: each stage the fewest blocks that
    # leave a split of the rest
    split, start = [], 0
    for stage in range(stages - 1):
        left = stages - 1 - stage  # stages after this one
        extra = embedding if stage == 0 else 0
        end = next(j for j in range(start + 1, n - left + 1)
                   if span(start, j) + extra <= bottleneck and holds(need, j, left))
        split.append(end - start)
        start = end
    split.append(n - start)
    return tuple(split)


@dataclass(frozen=True)
class Edge:
    """A tensor made on one virtual stage and read on another: a send/recv per micro-batch."""

    index: int  # deterministic: order of first use in the program; names the tag
    tensor: str
    source: int  # virtual stages
    target: int


def layer_crossings(graph) -> list[tuple[str, int, int]]:
    """Each read of a tensor made by an op of another layer (the step's ops aside), in program
    order: (tensor, its maker's layer, the reader's layer). Only these can cross a stage cut:
    a layer is never split between stages."""
    from stg.graph import Phase

    made_in, crossings = {}, []
    for op in graph.ops:
        if op.phase is Phase.STEP:
            continue
        for name in op.inputs:
            layer = made_in.get(name)
            if layer is not None and layer != op.layer:
                crossings.append((name, layer, op.layer))
        for name in op.outputs:
            made_in[name] = op.layer
    return crossings


def cut(graph, stages: StagePlan, crossings: list | None = None) -> list[Edge]:
    """Every (tensor, reading stage) whose producer runs on another stage, in program order.
    A tensor read by several ops of one stage (a block input that its forward and backward
    both read) crosses once. `crossings`: layer_crossings(graph), when known."""
    edges: dict[tuple[str, int], Edge] = {}
    for name, made, read in layer_crossings(graph) if crossings is None else crossings:
        source, stage = stages.virtual_stage(made), stages.virtual_stage(read)
        if source != stage and (name, stage) not in edges:
            edges[(name, stage)] = Edge(len(edges), name, source, stage)
    return list(edges.values())


def untie(forward, stages: StagePlan) -> tuple[object, dict[str, tuple[tuple[str, int], ...]]]:
    """A weight read on several stages (an output layer tied to the embedding) gets a copy on
    each stage after its first, as Megatron keeps the embedding on the first stage and a copy
    for the output layer on the last. Returns the graph and, per tied weight, its
    (copy, virtual stage) pairs; their gradients are summed across the stages each step
    (`tie_gradients`)."""
    from dataclasses import replace

    from stg.graph import Graph

    ties = tie_copies(forward, stages)
    if not ties:
        return forward, {}
    tensors = dict(forward.tensors)
    copy_on = {(w, s): name for w, copies in ties.items() for name, s in copies}
    for (w, _), name in copy_on.items():
        tensors[name] = replace(forward.tensors[w], name=name)
    ops = tuple(replace(op, inputs=tuple(copy_on.get((i, stages.virtual_stage(op.layer)), i) for i in op.inputs))
                for op in forward.ops)
    graph = Graph(tensors, ops)
    graph.verify()
    return graph, ties


def _tied_readers(forward, stages: StagePlan) -> dict[str, dict[int, list[int]]]:
    """Per weight read on several virtual stages: the blocks reading it on each, by stage."""
    readers: dict[str, dict[int, list[int]]] = {}
    for name, layers in _shared_weights(forward).items():
        by_stage: dict[int, list[int]] = {}
        for layer in layers:
            by_stage.setdefault(stages.virtual_stage(layer), []).append(layer)
        if len(by_stage) > 1:
            readers[name] = dict(sorted(by_stage.items()))
    return readers


@per_graph
def _shared_weights(forward) -> dict[str, list[int]]:
    """Per weight that ops of more than one block read, those blocks in op order: gathered once
    per forward graph (every plan asks whether its cut ties weights)."""
    readers: dict[str, list[int]] = {}
    for op in forward.ops:
        for name in op.inputs:
            if forward.tensors[name].role.value == "weight":
                layers = readers.setdefault(name, [])
                if op.layer not in layers:
                    layers.append(op.layer)
    return {w: layers for w, layers in readers.items() if len(layers) > 1}


def tie_copies(forward, stages: StagePlan) -> dict[str, tuple[tuple[str, int], ...]]:
    """untie's copies, without the graph: per tied weight, (copy, virtual stage) pairs."""
    return {w: tuple((w if n == 0 else f"{w}@stage{s}", s) for n, s in enumerate(readers))
            for w, readers in _tied_readers(forward, stages).items()}


def tie_pattern(forward, stages: StagePlan) -> tuple:
    """Which blocks read which copy of each tied weight, without the stage numbers that name the
    copies: two cuts with one pattern untie into one graph up to those names (`retie`)."""
    return tuple((w, tuple(map(tuple, by_stage.values()))) for w, by_stage in _tied_readers(forward, stages).items())


def retie(sharded, ties: dict, other: dict):
    """`sharded` (untied into copies `ties`, not yet tie_gradients'd) with each copy and every
    tensor and op derived from it named after the copies `other` of the same pattern: a
    tied model's passes are run once per pattern, not once per stage cut."""
    import re

    from stg.graph import Graph
    from stg.sharding import ShardedGraph

    mapping = {old: new for w in ties for (old, _), (new, _) in zip(ties[w], other[w]) if old != new}
    if not mapping:
        return sharded
    # a copy's name, whole or as the head of a derived one (not as a prefix of a longer stage number)
    pattern = re.compile("|".join(re.escape(old) + r"(?!\d)" for old in sorted(mapping, key=len, reverse=True)))
    name = lambda text: pattern.sub(lambda m: mapping[m.group(0)], text) if "@stage" in text else text

    def value(v):
        return name(v) if isinstance(v, str) else type(v)(map(value, v)) if isinstance(v, (tuple, list)) else v
    tensor = lambda t: t.renamed(name(t.name)) if "@stage" in t.name else t
    ops = tuple(op.renamed(name(op.name), tuple(map(name, op.inputs)), tuple(map(name, op.outputs)), op.layer,
                           {k: value(v) for k, v in op.attrs.items()})
                if any("@stage" in n for n in (op.name, *op.inputs, *op.outputs)) else op for op in sharded.graph.ops)
    graph = Graph({name(n): tensor(t) for n, t in sharded.graph.tensors.items()}, ops)
    return ShardedGraph(graph, {name(n): layout for n, layout in sharded.layouts.items()},
                        {name(n): tensor(t) for n, t in sharded.global_tensors.items()}, sharded.mesh_axes,
                        {name(n): origin for n, origin in sharded.origins.items()})


def tie_gradients(sharded, ties: dict, stages: StagePlan):
    """Before each tied copy's optimizer step, an ALL_REDUCE of its gradient over the stages
    that hold a copy (Megatron's embedding group), so every copy takes the same step."""
    from dataclasses import replace

    import sympy

    from stg.graph import Graph, Op, OpKind, Phase
    from stg.redistribute import Collective
    from stg.sharding import ShardedGraph

    if not ties:
        return sharded
    members = {name: tuple(sorted(stages.rank_and_chunk(s)[0] for _, s in copies))
               for copies in ties.values() for name, _ in copies}
    graph = sharded.graph
    tensors, layouts, global_tensors = dict(graph.tensors), dict(sharded.layouts), dict(sharded.global_tensors)
    ops, changed = [], set()
    for op in graph.ops:
        weight = op.attrs["weight"] if op.kind is OpKind.OPTIMIZER else None
        if weight in members:
            changed.add(op.name)
            grad = op.inputs[0]
            summed = f"{grad}.tied_all_reduce"
            tensors[summed] = replace(tensors[grad], name=summed)
            global_tensors[summed] = replace(global_tensors[grad], name=summed)
            layouts[summed] = layouts[grad]
            ops.append(Op(summed, OpKind.COLLECTIVE, (grad,), (summed,), sympy.Integer(0),
                          tensors[grad].nbytes, Phase.STEP, op.layer,
                          {"detail": "all_reduce", "collective": Collective.ALL_REDUCE, "axes": ("pp",),
                           "members": members[weight]}))
            op = replace(op, inputs=(summed, *op.inputs[1:]))
        ops.append(op)
    # a tied copy's optimizer step reads the summed gradient: no longer the op of its origin
    origins = {n: origin for n, origin in sharded.origins.items() if n not in changed}
    result = ShardedGraph(Graph(tensors, tuple(ops)), layouts, global_tensors, sharded.mesh_axes, origins)
    result.graph.verify()
    return result
