"""Pipeline parallelism: blocks placed on stages; the schedule (stg/schedule.py) orders them.

The model's blocks are split over pp * vpp virtual stages, evenly unless the plan gives
`layers_per_stage`; the first virtual stage also holds the embedding (block 0), the last
the output layer and loss (block L + 1). Virtual stage c * pp + r runs on pipeline rank r as
its chunk c (Megatron's interleaving). Edges between stages become send/recv pairs when
the rank classes are lowered (stg/lower.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from stg.errors import PlanError
from stg.plan import Plan


@dataclass(frozen=True)
class StagePlan:
    pp: int
    vpp: int
    first_block: tuple[int, ...]  # per virtual stage: its first block (1-based), then the next's

    @property
    def stages(self) -> int:
        return self.pp * self.vpp

    def virtual_stage(self, layer: int) -> int:
        """The virtual stage that runs block `layer` (0: embedding, L + 1: head)."""
        for stage in range(self.stages - 1, -1, -1):
            if layer >= self.first_block[stage]:
                return stage
        return 0

    def rank_and_chunk(self, stage: int) -> tuple[int, int]:
        return stage % self.pp, stage // self.pp


def stage_plan(plan: Plan, layers: int) -> StagePlan:
    stages = plan.pp * plan.vpp
    if plan.layers_per_stage is not None:
        split = plan.layers_per_stage
        if sum(split) != layers:
            raise PlanError(f"layers_per_stage: {list(split)} sums to {sum(split)}, but the model has {layers} blocks")
    else:
        if layers % stages:
            raise PlanError(
                f"pp*vpp={stages} does not divide layers={layers}; give layers_per_stage for an uneven split"
            )
        split = (layers // stages,) * stages
    first, start = [], 1
    for count in split:
        first.append(start)
        start += count
    first[0] = 0  # the embedding goes with the first stage
    return StagePlan(plan.pp, plan.vpp, tuple(first))


@dataclass(frozen=True)
class Edge:
    """A tensor made on one virtual stage and read on another: a send/recv per micro-batch."""

    index: int  # deterministic: order of first use in the program; names the tag
    tensor: str
    source: int  # virtual stages
    target: int


def cut(graph, stages: StagePlan) -> list[Edge]:
    """Every (tensor, reading stage) whose producer runs on another stage, in program order.
    A tensor read by several ops of one stage (a block input that its forward and backward
    both read) crosses once."""
    from stg.graph import Phase

    made_on = {}
    edges: dict[tuple[str, int], Edge] = {}
    for op in graph.ops:
        if op.phase is Phase.STEP:
            continue
        stage = stages.virtual_stage(op.layer)
        for name in op.inputs:
            source = made_on.get(name)
            if source is not None and source != stage and (name, stage) not in edges:
                edges[(name, stage)] = Edge(len(edges), name, source, stage)
        for name in op.outputs:
            made_on[name] = stage
    return list(edges.values())


def untie(forward, stages: StagePlan) -> tuple[object, dict[str, tuple[tuple[str, int], ...]]]:
    """A weight read on several stages (an output layer tied to the embedding) gets a copy on
    each stage after its first, as Megatron keeps the embedding on the first stage and a copy
    for the output layer on the last. Returns the graph and, per tied weight, its
    (copy, virtual stage) pairs; their gradients are summed across the stages each step
    (`tie_gradients`)."""
    from dataclasses import replace

    from stg.graph import Graph

    stages_of: dict[str, list[int]] = {}
    for op in forward.ops:
        for name in op.inputs:
            if forward.tensors[name].role.value == "weight":
                stage = stages.virtual_stage(op.layer)
                if stage not in stages_of.setdefault(name, []):
                    stages_of[name].append(stage)
    ties = {w: tuple((w if n == 0 else f"{w}@stage{s}", s) for n, s in enumerate(sorted(ss)))
            for w, ss in stages_of.items() if len(ss) > 1}
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
    ops = []
    for op in graph.ops:
        weight = op.attrs["weight"] if op.kind is OpKind.OPTIMIZER else None
        if weight in members:
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
    result = ShardedGraph(Graph(tensors, tuple(ops)), layouts, global_tensors, sharded.mesh_axes)
    result.graph.verify()
    return result
