"""Lowering: the sharded graph, bound to numbers, becomes the node list of one rank *class*.

Ranks that run the same program up to their communicator groups and peers form a class and
share one RankProgram. Where a node names a group it holds a GroupHole (which group along
which mesh axes), filled in per rank by byte patching when the files are written
(stg/chakra/writer.py); nothing here runs per rank.

Order (DESIGN.md, "Chakra output"): all orderings go into data deps. Compute nodes form one
chain in program order (one compute stream); collectives and sends form another (ASTRA-sim
runs one at a time per rank and pairs the k-th collectives of a group's members, so ranks of
a class must issue them in one order: a rank free to pick the next ready one can deadlock
against a peer that picked another group's -- the replay found such a case); each follows
its input's producer, and consumers follow what they read.

Collectives that move parameters or gradients are coalesced, as frameworks do:
- in the step, gradient reductions go in buckets of `bucket_bytes` in the order the last
  micro-batch finishes the gradients (PyTorch DDP), so they overlap the rest of that
  backward (with a pipeline, after the stage's last action: plan_gradient_buckets says
  why); the optimizer follows; the new parameters' gathers go in buckets after it;
- within a micro-batch (ZeRO-2/3), one collective per block and phase (an FSDP unit): the
  parameter gather before the block's first use, issued one unit ahead of compute, and the
  gradient reduce-scatter once the block's last gradient is done.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter
from dataclasses import dataclass, field, replace
from functools import cached_property
from itertools import groupby, pairwise
from operator import attrgetter, itemgetter
from typing import Callable, Iterable, Iterator, Mapping

import sympy

from stg.device import DeviceSpec
from stg.errors import LayoutError
from stg.graph import VIEWS, DType, Op, OpKind, Phase, Role
from stg.mesh import axis_symbol
from stg import numeric
from parallelism.pipeline import Edge, StagePlan, block_weight, layer_crossings
from stg.blocks import blocks
from stg.borrowed import StageTemplates, wire, wire_own
from stg.program import (ClassStats, GroupHole, NodeType, RankHole, RankProgram, ReplayChunks, Repeats, TraceNode,
                         replay_nodes)
from stg.repeats import (COMM_ROLE, COMPUTE_ROLE, ActionNodes, ActionTally, LayerNodes, add_terms, add_to, alike_tally,
                         combined, flush_compact, tallies)
from stg.schedule import Action, Kind, Order, order, virtual_stage, walked
from stg.shapes import Renaming, edge_moves, layer_shape, moved_here, shape_of, stage_likeness, step_shape
from stg.sharding import CUT_LIMIT, ShardedGraph, op_places, per_graph


class Evaluator:
    """Binds symbols to integers, once per distinct expression (never per node per rank): by
    the expression's compiled form (stg/numeric.py) where its symbols are bound to exact
    numbers, else by sympy."""

    def __init__(self, bindings: Mapping[sympy.Symbol, object]):
        self.bindings = {k: sympy.sympify(v) for k, v in bindings.items()}
        self.numbers = {k: n for k, v in self.bindings.items() if (n := numeric.exact(v)) is not None}
        self.cache: dict[sympy.Expr, int] = {}
        self.bound: dict[tuple, ClassStats] = {}  # tallies bound under these bindings (_ProgramBuilder._bound)
        self.timing: dict[tuple, dict] = {}  # ops' durations under these bindings (_ProgramBuilder._costs)
        self.layers: dict[tuple, object] = {}  # layers' nodes recorded under them (_ProgramBuilder._run_alike)
        self.held: dict[tuple, tuple] = {}  # pipeline stages' memory shares sized under them (stg/memory.py)

    def __call__(self, expr: sympy.Expr) -> int:
        found = self.cache.get(expr)
        if found is None:
            found = self.cache[expr] = numeric.ceiling(numeric.bound(expr, self.numbers, self.bindings))
        return found


@per_graph
def _splits(sharded: ShardedGraph) -> tuple[tuple[sympy.Expr, tuple[str, ...], str, str], ...]:
    """Each distinct (dimension size, mesh axes splitting it) of the graph, with the first
    tensor and logical axis that have it (for the error)."""
    names, layouts = list(sharded.layouts), list(sharded.layouts.values())
    tensors = list(map(sharded.global_tensors.__getitem__, names))
    # the copies of a block share their layout and shape objects: each (layout, shape, dims)
    # once, at its first place (found without a Python loop over tens of thousands of names)
    pairs = list(zip(map(id, layouts), map(id, map(_SHAPE, tensors)), map(id, map(_DIMS, tensors))))
    firsts = sorted(dict(zip(reversed(pairs), range(len(pairs) - 1, -1, -1))).values())
    found: dict[tuple, tuple[str, str]] = {}
    for place in firsts:
        tensor, layout = tensors[place], layouts[place]
        for dim, (size, logical) in enumerate(zip(tensor.shape, tensor.dims)):
            axes = layout.axes_sharding(dim)
            if axes and not _padded(logical):
                found.setdefault((size, axes), (logical, names[place]))
    return tuple((size, axes, logical, name) for (size, axes), (logical, name) in found.items())


_SHAPE, _DIMS = attrgetter("shape"), attrgetter("dims")


def check_divisibility(sharded: ShardedGraph, bindings: Mapping[sympy.Symbol, int]) -> None:
    """Every split dimension divides evenly, or a LayoutError names tensor, axis and sizes."""
    for size, axes, logical, name in _splits(sharded):
        value = int(size.xreplace(bindings))
        parts = int(sympy.Mul(*(axis_symbol(a) for a in axes)).xreplace(bindings))
        if value % parts:
            split = "*".join(f"{a}={int(axis_symbol(a).xreplace(bindings))}" for a in axes)
            raise LayoutError(f"{split} does not divide {logical} dimension {size}={value} of tensor {name}")


def _padded(logical: str) -> bool:
    """Dimensions split unevenly by design: expert buffers and stacked embedding rows are
    padded up per rank; a rank's share of routed ids is a mean (model_zoo/moe.py, dlrm.py)."""
    return logical == "capacity" or logical.endswith((".rows", ".ids"))


_MOVED = (Role.WEIGHT, Role.GRADIENT)  # what FSDP's units move


def _unit(op: Op, graph) -> tuple | None:
    """The coalescing unit of a collective that moves parameters or gradients (FSDP's unit:
    one block, one phase); None for activation traffic, which runs where it stands."""
    if op.kind is not OpKind.COLLECTIVE:
        return None
    role = graph.tensors[op.inputs[0]].role
    if role not in _MOVED:
        return None
    return (role, op.phase, op.layer, op.attrs["collective"], op.attrs["axes"])


@dataclass(frozen=True)
class Pipeline:
    """What a rank class needs of the pipeline: its schedule and the stage cut."""

    stages: StagePlan
    order: Order  # the schedule, its actions made on first use
    split_backward: bool
    edges: tuple[Edge, ...]

    @property
    def schedule(self) -> tuple[tuple[Action, ...], ...]:
        return self.order.stages

    @classmethod
    def single_stage(cls, microbatches: int) -> "Pipeline":
        return cls(StagePlan(1, 1, (0,)), order("1f1b", 1, microbatches), False, ())


@per_graph
def _segments(sharded: ShardedGraph, split_backward: bool) -> list[tuple[int, Kind | None, list[Op], dict]]:
    """The graph's ops in program order as runs of one layer and action kind (None: the step,
    whose runs hold the optimizer's ops: _step_plans deals out its collectives), each with its
    ops by coalescing unit: what a stage cut deals out whole (every cut of a structure reads
    them). Without a split backward, a layer's input and weight gradients, which alternate,
    are one run."""
    found, graph = [], sharded.graph
    reductions, deferred = _step_collectives(sharded)
    apart = {op.name for op, _ in reductions} | {op.name for op in deferred}
    # a graph bound from another (unit_bound) has its ops but for some collectives: a run of a
    # micro-batch's ops (no step op is apart) whose collectives it kept is that graph's run
    base = None if sharded.base is None else sharded.base.graph.ops
    inherited = () if base is None else _segments(sharded.base, split_backward)
    for run, (start, end, layer, kind, collectives, movers) in enumerate(_segment_places(sharded.skeleton,
                                                                                         split_backward)):
        if base is not None and kind is not None and all(graph.ops[place] is base[place] for place in collectives):
            found.append(inherited[run])
            continue
        ops = list(graph.ops[start:end]) if kind is not None else \
            [op for op in graph.ops[start:end] if op.name not in apart]
        units: dict[tuple, list[Op]] = {}
        for place in movers:
            op = graph.ops[place]
            if op.kind is OpKind.COLLECTIVE and op.name not in apart and (unit := _unit(op, graph)) is not None:
                units.setdefault(unit, []).append(op)
        found.append((layer, kind, ops, units))
    return found


@per_graph
def _segment_places(skeleton: ShardedGraph, split_backward: bool) -> list[tuple[int, int, int, Kind | None, list[int],
                                                                               list[int]]]:
    """_segments's runs by place (start, end, layer, kind, the places of the collectives among
    them, and of those that move a weight or a gradient, which alone may have a coalescing
    unit): the same in every graph bound from the skeleton (a binding changes a collective's
    axes or kind, never what it reads)."""
    ops, step, tensors = skeleton.graph.ops, Phase.STEP, skeleton.graph.tensors
    kinds = {phase: None if phase is step else _kind(phase, split_backward) for phase in Phase}
    found, start = [], 0
    for (layer, kind), run in groupby(ops, key=lambda op: (op.layer, kinds[op.phase])):
        end = start + sum(1 for _ in run)
        found.append((start, end, layer, kind, [], []))
        start = end
    ends = [end for _, end, _, _, _, _ in found]
    collectives = op_places(skeleton).collectives
    for place in collectives:
        found[bisect_right(ends, place)][4].append(place)
    for place in [place for place in collectives if tensors[ops[place].inputs[0]].role in _MOVED]:
        found[bisect_right(ends, place)][5].append(place)
    return found


def _kind(phase: Phase, split_backward: bool) -> Kind:
    """The action kind that runs a (non-step) op of `phase`."""
    return _KINDS[phase, split_backward]


# one autograd backward (split_backward False): input and weight gradients in program order
_KINDS = {(phase, split): {Phase.FORWARD: Kind.F, Phase.BACKWARD_INPUT: Kind.B}.get(phase, Kind.W if split else Kind.B)
          for phase in Phase for split in (False, True)}


def _run(op: Op, stages: StagePlan, split_backward: bool) -> tuple[int, Kind]:
    """The run (virtual stage, action kind) of _stage_work that holds a non-step op."""
    return stages.virtual_stage(op.layer), _kind(op.phase, split_backward)


@per_graph(limit=CUT_LIMIT)
def _stage_work(sharded: ShardedGraph, stages: StagePlan, split_backward: bool) -> dict[int, tuple]:
    """Per pipeline stage, its share of the graph: per (virtual stage, action kind) its ops in
    program order, the parameter/gradient collectives per coalescing unit, its optimizer's ops, and
    per (virtual stage, action kind) its ops layer by layer, each with the key its tally is
    kept by (_add_layers: an action runs a layer's ops of its kind whole)."""
    work = {rank: ({}, {}, [], {}) for rank in range(stages.pp)}
    stage_of: dict[int, int] = {}
    for layer, kind, ops, op_units in _segments(sharded, split_backward):
        stage = stage_of.get(layer)
        if stage is None:
            stage = stage_of[layer] = stages.virtual_stage(layer)
        runs, units, step, layers = work[stages.rank_and_chunk(stage)[0]]
        if kind is None:
            step += ops
            continue
        runs.setdefault((stage, kind), []).extend(ops)
        for unit, unit_ops in op_units.items():
            units.setdefault(unit, []).extend(unit_ops)
        pieces = layers.setdefault((stage, kind), [])
        if pieces and pieces[-1][0] == layer:  # a split backward's layer: its B (or W) segments, one after another
            pieces[-1][1].extend(ops)
        else:
            pieces.append((layer, list(ops)))
    weight = stages.weight  # (a short model's block stands for several: stg/short.py)
    for _, _, _, layers in work.values():
        for run, pieces in layers.items():
            layers[run] = tuple((("layer", ops[0].name, len(ops)), ops) for layer, ops in pieces
                                for _ in range(weight(layer)))
    return work


def _made_by(graph, tensor: str) -> Op | None:
    """The op that computes `tensor`, looking through views."""
    return graph.producer.get(_viewed(graph, tensor))


@dataclass(frozen=True)
class _StepPlan:
    """What a pipeline stage's step sends besides running its optimizer: the reductions of
    gradients its micro-batches make, per run of one virtual stage and kind in the order its
    ops finish them (the gradient buckets cut these, each flushed after its last reduction's
    finishing op, `made`), and the collectives that go out after the optimizer, bucketed
    (the new parameters' gathers: those no backward sent and no step compute reads)."""

    reductions: Mapping[tuple, list[Op]]  # by run ((virtual stage, action kind) of _stage_work)
    made: Mapping[str, Op]  # a reduction -> the op that finishes its gradient
    deferred: list[Op]


@per_graph
def _step_collectives(sharded: ShardedGraph) -> tuple[list[tuple[Op, Op]], list[Op]]:
    """The step's collectives as every stage cut deals them out (_step_plans): the reductions
    of what a micro-batch computed, each with the op that finishes it (looking through views;
    none for one over pp), in the order those ops run; and the rest that no step op but a
    view reads (the new parameters' gathers), in program order."""
    graph, places = sharded.graph, op_places(sharded.skeleton)
    reductions, deferred = [], []
    for place in places.step_collectives:
        op = graph.ops[place]
        if op.kind is OpKind.COLLECTIVE:  # not bound to a view
            made = None if "pp" in op.attrs["axes"] else _made_by(graph, op.inputs[0])
            if made is not None and made.phase is not Phase.STEP:
                reductions.append((op, made))
            elif not any(user.kind not in VIEWS for user in graph.consumers.get(op.outputs[0], ())):
                deferred.append(op)
    reductions.sort(key=lambda pair: places.place[pair[1].name])
    return reductions, deferred


@per_graph(limit=CUT_LIMIT)
def _step_plans(sharded: ShardedGraph, stages: StagePlan, split_backward: bool) -> dict[int, _StepPlan]:
    """Per pipeline stage, its _StepPlan: the step collectives of the layers the cut gives it."""
    # A reduction over pipeline stages (a tied embedding's) waits for the flush, as Megatron's
    # embedding all-reduce does: on the one comm chain it would otherwise go ahead of sends
    # that its peer stage needs before it can join (a deadlock).
    rank_of: dict[int, int] = {}

    def rank(layer: int) -> int:
        if layer not in rank_of:
            rank_of[layer] = stages.rank_and_chunk(stages.virtual_stage(layer))[0]
        return rank_of[layer]
    by_run: dict[int, dict[tuple, list[Op]]] = {r: {} for r in range(stages.pp)}
    made: dict[int, dict[str, Op]] = {r: {} for r in range(stages.pp)}
    for layer, by_layer, kind, ops, made_by in _weighted(_reduction_runs(sharded, split_backward), itemgetter(0),
                                                         stages):
        r = rank(layer)  # a step op is its layer's stage's (_stage_work)
        made[r].update(made_by)
        by_run[r].setdefault((stages.virtual_stage(by_layer), kind), []).extend(ops)
    later: dict[int, list[Op]] = {r: [] for r in range(stages.pp)}
    for op in _weighted(_step_collectives(sharded)[1], attrgetter("layer"), stages):
        later[rank(op.layer)].append(op)
    return {r: _StepPlan(by_run[r], made[r], later[r]) for r in range(stages.pp)}


def _weighted(items: list, layer_of: Callable, stages: StagePlan) -> Iterable:
    """`items` in order, each stretch of one layer's as often as `stages` weighs that layer
    (a short model's block standing for several, stg/short.py: the real blocks' items follow
    one another block by block)."""
    if not stages.weights:
        return items
    return (item for layer, stretch in groupby(items, key=layer_of) for item in list(stretch) * stages.weight(layer))


@per_graph
def _reduction_runs(sharded: ShardedGraph, split_backward: bool) -> list[tuple[int, int, Kind, list[Op], dict]]:
    """_step_collectives's reductions in runs of one layer whose ops are finished by ops of one
    layer and action kind: (the layer, the finishing layer, its kind, the reductions, each's
    finishing op), what a stage cut deals out whole (_step_plans)."""
    runs = []
    for (layer, by_layer, kind), pairs in groupby(_step_collectives(sharded)[0], key=lambda pair: (
            pair[0].layer, pair[1].layer, _kind(pair[1].phase, split_backward))):
        pairs = list(pairs)
        runs.append((layer, by_layer, kind, [op for op, _ in pairs], {op.name: by for op, by in pairs}))
    return runs


@dataclass(frozen=True)
class _BucketSteps:
    """A list of step collectives as the bucketing reads it (_ProgramBuilder._bucket_starts):
    per op, its kind (collective name and axes), group and byte expression, each an index into
    the graph's distinct ones (_step_kinds); and per collective name how many ops have each
    expression. Per values of the expressions and bucket size (a plan's sizes cut the buckets;
    plans of one size share them, _ProgramBuilder._per_sizes): `starts`, where its buckets
    start; `opened`, the groups its buckets open and the bytes per collective; `flushed`,
    without a pipeline, the buckets that go out after each op and the run's flushes."""

    ops: list[tuple[int, int, int]]
    groups: list[tuple[str, GroupHole]]
    exprs: list[sympy.Expr]
    bytes: dict[str, Counter]
    starts: dict[tuple, list[int]] = field(default_factory=dict)
    opened: dict[tuple, tuple[list, list]] = field(default_factory=dict)
    flushed: dict[tuple, tuple[dict, tuple]] = field(default_factory=dict)


@per_graph
def _step_kinds(sharded: ShardedGraph) -> tuple[dict[str, tuple[int, int, int]], list[str], list, list]:
    """Each step collective's (kind, group, byte expression) as indices into the graph's
    distinct ones -- kinds (by collective name and axes, with each kind's collective name),
    groups (name, GroupHole) and expressions (by identity: a block's copies share theirs) --
    found once for the lists that every cut and plan buckets."""
    kinds: dict[tuple, int] = {}
    groups: dict[tuple, int] = {}
    exprs: dict[int, int] = {}
    found, expr_list, ops = {}, [], sharded.graph.ops
    for place in op_places(sharded.skeleton).step_collectives:
        if (op := ops[place]).kind is OpKind.COLLECTIVE:  # not bound to a view
            attrs = op.attrs
            name, axes = attrs["collective"].name, attrs["axes"]
            expr = exprs.setdefault(id(op.bytes), len(exprs))
            if expr == len(expr_list):
                expr_list.append(op.bytes)
            found[op.name] = (kinds.setdefault((name, axes), len(kinds)),
                              groups.setdefault((name, axes, attrs.get("members")), len(groups)), expr)
    return (found, [name for name, _ in kinds], [(name, GroupHole(axes, members)) for name, axes, members in groups],
            expr_list)


@per_graph(limit=CUT_LIMIT)
def _bucket_lists(sharded: ShardedGraph, stages: StagePlan, split_backward: bool) -> dict[int, tuple]:
    """_bucket_steps's answers for the step lists of a stage cut, by the id of the list (kept
    beside its answer, with the first list that buckets alike, _alike_steps): a list is
    bucketed for every plan of the structure and cut."""
    return {}


@per_graph
def _alike_steps(sharded: ShardedGraph) -> dict[tuple, _BucketSteps]:
    """The first _BucketSteps of each content (_ProgramBuilder._steps_of)."""
    return {}


def _bucket_steps(sharded: ShardedGraph, ops: list[Op]) -> _BucketSteps:
    """The _BucketSteps of `ops`, step collectives of `sharded`."""
    found, names, groups, exprs = _step_kinds(sharded)
    steps = [found[op.name] for op in ops]
    nbytes: dict[str, Counter] = {}
    for (kind, expr), n in Counter((kind, expr) for kind, _, expr in steps).items():
        nbytes.setdefault(names[kind], Counter())[expr] += n
    return _BucketSteps(steps, groups, exprs, nbytes)


def _step_layers(ops: list[Op], stages: StagePlan | None = None) -> tuple:
    """A stage's optimizer ops layer by layer, keyed like _stage_work's (a run of one layer's ops
    in program order is its first and how many): the step runs those the cut leaves it, each
    layer as often as `stages` weighs it (a short model's block standing for several)."""
    weight = block_weight(stages)
    return tuple((("step layer", layer[0].name, len(layer)), layer) for layer in blocks(ops)
                 for _ in range(weight(layer[0].layer)))


@per_graph
def crossings(skeleton: ShardedGraph) -> list[tuple[str, int, int]]:
    """parallelism.pipeline.layer_crossings of the graph: what any stage cut may send."""
    return layer_crossings(skeleton.graph)


@per_graph
def _may_cross(skeleton: ShardedGraph) -> frozenset[str]:
    """The tensors some stage cut may send (crossings): a cut's edge tensors are among them."""
    return frozenset(name for name, _, _ in crossings(skeleton))


@per_graph
def _crossable(sharded: ShardedGraph) -> dict[tuple, tuple[str, ...]]:
    """Per layer tally key (_stage_work), the tensors that layer's run makes that some cut may
    send (_may_cross; filled by _ProgramBuilder._add_layers)."""
    return {}


@per_graph(limit=CUT_LIMIT)
def _crossing_made(sharded: ShardedGraph, stages: StagePlan, split_backward: bool) -> dict[tuple, tuple[str, ...]]:
    """Per layer tally key (_stage_work), the cut's edge tensors that layer makes, by stage cut
    and backward split (filled by _ProgramBuilder._add_layers)."""
    return {}


@dataclass(frozen=True)
class _LayerKeys:
    """What _ProgramBuilder._layer_tally finds of the layer runs of a skeleton, for every graph
    bound from it (the same names, so the same origins): per layer tally key (_stage_work,
    _step_layers), the key of the tally its ops share with every run of the same ops of a
    block's copies (the run's origins numbered, a short key); the places of the tensors such a
    tally makes, one object per distinct tuple; and per (layer key, those places' id) the
    names they are in that run."""

    alike: dict[tuple, tuple] = field(default_factory=dict)
    numbers: dict[tuple, int] = field(default_factory=dict)
    places: dict[tuple, tuple] = field(default_factory=dict)
    made: dict[tuple, tuple[str, ...]] = field(default_factory=dict)


@per_graph
def _alike_keys(skeleton: ShardedGraph) -> _LayerKeys:
    return _LayerKeys()


@per_graph
def _run_edges(sharded: ShardedGraph) -> dict:
    """_ProgramBuilder._edges's answers, by stage cut and backward split: the edges into and
    out of each run (virtual stage, kind)."""
    return {}


@per_graph
def _collective_readers(sharded: ShardedGraph) -> dict[str, list[Op]]:
    """Per tensor, the collectives that read it, directly or through views
    (_ProgramBuilder._read_later, _noted)."""
    graph, found = sharded.graph, {}
    for op in graph.ops:
        if op.kind is OpKind.COLLECTIVE:
            for tensor in op.inputs:
                while True:  # up the views it reads through
                    found.setdefault(tensor, []).append(op)
                    maker = graph.producer.get(tensor)
                    if maker is None or maker.kind not in VIEWS:
                        break
                    tensor = maker.inputs[0]
    return found


@per_graph
def _noted_names(sharded: ShardedGraph, edges: frozenset[str]) -> frozenset[str]:
    """_ProgramBuilder._noted, per structure and the cut's edge tensors."""
    return frozenset(_collective_readers(sharded)) | edges | {_viewed(sharded.graph, name) for name in edges}


def _viewed(graph, tensor: str) -> str:
    """The tensor that `tensor` views (itself if it is no view's output): whose producer a
    lookup of `tensor` finds (_ProgramBuilder.producer)."""
    op = graph.producer.get(tensor)
    while op is not None and op.kind in VIEWS:
        tensor = op.inputs[0]
        op = graph.producer.get(tensor)
    return tensor


@per_graph
def _layer_reads(sharded: ShardedGraph) -> dict:
    """Per layer (_stage_work's layer key), the tensors its ops make that collectives read
    (_collective_readers), a few of its hundreds, each as _layer_read gives it, those the
    step's read apart: found once per structure (_ProgramBuilder._run_reads)."""
    return {}


def _layer_read(tensor: str, maker: Op, readers: list[Op]) -> tuple[str, bool, tuple[tuple[int, Phase], ...]]:
    """A tensor of a layer as _read_later reads it: whether the step's collectives read it,
    and the layers and phases of its other readers but its maker's own (of its run in any cut)."""
    return (tensor, any(op.phase is Phase.STEP for op in readers),
            tuple({(op.layer, op.phase): None for op in readers if op.phase is not Phase.STEP
                   and (op.layer != maker.layer or op.phase is not maker.phase)}))


@per_graph
def _reads_later(sharded: ShardedGraph) -> dict:
    """_ProgramBuilder._read_later's answers, by stage cut, backward split, run and last, and
    _last_apart's (last: "apart"), and apart_runs' (by rank)."""
    return {}


_TYPE_NAMES = {kind: kind.name for kind in NodeType}


class _ProgramBuilder:
    """Builds one class's nodes; with `keep_nodes=False` only its stats and holes (stg.evaluate):
    no node objects, and an action that repeats one already run (same chunk and kind, same
    earlier actions of its micro-batch, same place before or after the last) adds that
    action's stats again instead of running its ops."""

    def __init__(self, sharded: ShardedGraph, evaluate: Evaluator, device: DeviceSpec, bucket_bytes: int,
                 pipeline: Pipeline, rank: int, comm_evaluate: Evaluator | None = None, keep_nodes: bool = True,
                 timing: bool = False, stage_templates: dict | None = None, rebindable: dict | None = None,
                 alike_to: int | None = None):
        self.sharded = sharded
        self.graph = sharded.graph
        self.ev = evaluate
        self.comm_ev = comm_evaluate or evaluate  # sizes that every member of a group must agree on
        self.device = device
        self.bucket_bytes = bucket_bytes
        self.pipeline = pipeline
        self.rank = rank  # the class's pipeline stage
        self.nodes: list[TraceNode] = []
        self.last_compute: int | None = None
        self._carry = 0.0  # rounding error of the durations so far, in microseconds (carry)
        self.carried_by: Repeats | None = None  # the repeats flushed last, if the carry is theirs
        self.last_comm: int | None = None  # the rank's previous collective or send
        self.alias: dict[str, str] = {}  # a view (slice, anchor) -> the tensor it views
        self.prefetch: dict[Phase, int | None] = {}  # compute running when the last unit gather went out
        self.flush_after: dict[str, list[list[Op]]] = {}  # op -> gradient buckets that go out after it
        # by run: its ops that buckets go out after, in run order, with their buckets' sizes
        # (without nodes: empty, the buckets are counted per plan, _count_actions)
        self.flushes: dict[tuple, tuple] = {}
        self.late_reductions: list[list[Op]] = []  # with a pipeline: per run, what the step buckets
        self.stats = ClassStats()
        self.keep_nodes = keep_nodes
        self.holes: set = set()  # without nodes, the holes they would have had
        self.terms: Counter | None = None  # the tally of the action being run, without nodes
        self.op_costs: dict[str, tuple[int, int, float, str]] = {}
        # by origin (or name) and sizes: _costs; the plan's (its stages' layers are copies of a few blocks)
        self.op_timing: dict[tuple, tuple[float, str]] = self.ev.timing.setdefault(
            (id(device), self.keep_nodes), {}) if timing else {}
        self.origins = sharded.origins
        self._comm_ids: set[int] = set()  # nodes that are not COMP (comm_ids)
        self.comm_later: list[Repeats] = []  # and those of repeats flushed since it was asked
        self.exact: dict[int, float] = {}  # a COMP node -> its duration before rounding
        self.node_repeats: dict[tuple, ActionNodes | None] = {}  # with nodes: per action key
        self.repeat_stats: dict[int, list] = {}  # id -> [stats of a repeated action, times] (repeated)
        # timing: the program as the timed replay reads it; a repeated action adds its merged
        # nodes there and None to self.nodes (its ids are taken, no node is made)
        self.timing = timing
        self.replay = ReplayChunks()
        self.pending: list[tuple] = []  # repeated actions not yet in self.replay (flush_compact)
        self.head_of: dict[int, int] = {}  # the last node of a merged run -> its first
        self.microbatches = pipeline.order.m
        self.later: dict[tuple, frozenset[str]] = {}  # _read_later's answers, by run and last
        self.last_apart: dict[tuple, bool] = {}  # _last_apart's, by run
        self.viewed: set[tuple] = set()  # runs whose views are in self.alias (_views)
        # timing: templates of every stage of this plan by (shape, chains present): see _action_shape
        self.stage_templates: dict[tuple, tuple] = stage_templates if stage_templates is not None else {}
        # timing: the templates of every plan of this stage cut, whatever their sizes, to be bound
        # to this plan's (ActionNodes.rebound), and what each recorded node's sizes come from
        self.rebindable: dict[tuple, tuple] = rebindable if rebindable is not None else {}
        self.sized_by: dict[int, object] = {}  # a node -> its op, its collective's ops, or its bytes
        self.lowered: dict[tuple, ActionNodes] = {}  # timing: the templates this stage recorded, by key
        # timing: a stage alike to this one that ran before (_alike_stage), with the renaming of
        # its names to this one's; else what this stage leaves for a later one alike to it
        self.sibling: tuple[_StageRepeats, Renaming | None] | None = None
        self.alike_to = alike_to  # timing: an earlier stage alike to this one by its blocks (_alike_stage)
        self.sibling_moves: dict[tuple, tuple | None] = {}  # by virtual stage and kind: _sibling_edges
        self.likeness: tuple | None = None  # (its cut, stage_likeness's parts, places, first places)
        self.made: dict[tuple, ActionNodes] = {}  # timing: by action key and chains present, each template
        self.templated = True  # timing: every action came from one template per key and chains present
        self.kept_by: tuple | None = None  # timing: what its templates are kept by (_lowered_stages), if they may be
        self.step_template: ActionNodes | None = None

    def repeated(self, stats: ClassStats, times: int = 1) -> None:
        """A repeated action's stats, added once per distinct stats at the end (build)."""
        entry = self.repeat_stats.get(id(stats))
        if entry is None:
            entry = self.repeat_stats[id(stats)] = [stats, 0]
        entry[1] += times

    def unit(self, op: Op) -> tuple | None:
        return _unit(op, self.graph)

    @property
    def comm_ids(self) -> set[int]:
        """The nodes that are not COMP, the flushed repeats' added when first asked for (a
        stage wired whole never asks: its tens of thousands stay arrays)."""
        if self.comm_later:
            for repeats in self.comm_later:
                self._comm_ids.update(repeats.after[1].tolist())
            self.comm_later.clear()
        return self._comm_ids

    @property
    def carry(self) -> float:
        """The rounding error of the durations so far, in microseconds; the repeats flushed
        last found it when first asked for (a stage wired whole never asks)."""
        if self.carried_by is not None:
            self._carry, self.carried_by = self.carried_by.after[0], None
        return self._carry

    @carry.setter
    def carry(self, value: float) -> None:
        self._carry, self.carried_by = value, None

    def _add(self, **kwargs) -> int:
        node = TraceNode(id=len(self.nodes), **kwargs)
        self.nodes.append(node)
        self.stats.nodes[_TYPE_NAMES[node.type]] += 1
        if node.type is not NodeType.COMP_NODE:
            self.comm_ids.add(node.id)
        return node.id

    def _count_node(self, kind: NodeType, *holes, times: int = 1) -> None:
        """A node (or `times` alike ones) counted but not built (keep_nodes=False): its producer
        id is None."""
        self.stats.nodes[kind.name] += times
        self.holes.update(holes)

    def _count(self, field: str, key: str | None, expr, comm: bool = False, value: int | None = None) -> int:
        """Add `expr`'s value (under the shared evaluator when `comm`; `value` when known) to a
        stats field (at `key` of a Counter field); the action being tallied records the term."""
        if value is None:
            value = (self.comm_ev if comm else self.ev)(expr)
        add_to(self.stats, field, key, value)
        if self.terms is not None:
            self.terms[(field, key, comm, expr)] += 1
        return value

    def producer(self, tensor: str, where: dict[str, int]) -> int | None:
        while tensor in self.alias:
            tensor = self.alias[tensor]
        return where.get(tensor)

    def _costs(self, op: Op) -> tuple[int, int, float, str]:
        """An op's FLOPs, bytes, unrounded duration and type label, once per class (every
        micro-batch runs it); its duration and label once per origin and sizes
        (ShardedGraph.origins: the same op of a block's copies, the same roofline)."""
        costs = self.op_costs.get(op.name)
        if costs is None:
            flops, nbytes = self.ev(op.flops), self.ev(op.bytes)  # each op asks (a serving template records them)
            key = (self.origins.get(op.name) or op.name, flops, nbytes)
            timed = self.op_timing.get(key)
            if timed is None:
                exact = self.device.duration_us(flops, nbytes, self._operand_dtype(op), op.kind is OpKind.EINSUM) \
                    if self.keep_nodes else 0.0
                timed = self.op_timing[key] = (exact, op.label())
            costs = self.op_costs[op.name] = (flops, nbytes, *timed)
        return costs

    def compute(self, op: Op, label: str, where: dict[str, int]) -> None:
        flops, nbytes, exact, op_type = self._costs(op)
        self._count("flops_by_phase", op.phase.value, op.flops, value=flops)
        self._count("compute_bytes", None, op.bytes, value=nbytes)
        if op.attrs.get("recompute"):
            self._count("recompute_flops", None, op.flops, value=flops)
        if op.kind is OpKind.EINSUM and op.phase is not Phase.STEP:
            self._count("matmul_flops", None, op.flops, value=flops)
        if not self.keep_nodes:
            self._count_node(NodeType.COMP_NODE)
            where.update(dict.fromkeys(op.outputs))
            return
        duration = self._rounded(exact)
        deps = [self.last_compute] if self.last_compute is not None else []
        deps += sorted({p for i in op.inputs if (p := self.producer(i, where)) in self.comm_ids})
        node = self._add(
            name=f"{label} {op.name}", type=NodeType.COMP_NODE, deps=tuple(deps), flops=flops, nbytes=nbytes,
            duration_us=duration, op_type=op_type,
        )
        self.exact[node] = exact
        if self.timing:
            self.sized_by[node] = op
        self.last_compute = node
        noted = self._noted
        for out in op.outputs:
            if noted is None or out in noted:
                where[out] = node

    def _rounded(self, exact: float) -> int:
        """Whole microseconds, with the rounding error carried to the next node, so that a
        long chain of sub-microsecond ops keeps its total (ASTRA-sim replays 0 as 1 ns)."""
        exact += self.carry
        duration = max(0, round(exact))
        self.carry = exact - duration
        return duration

    def _operand_dtype(self, op: Op) -> DType:
        """A GEMM runs at the peak of its narrowest operand, or at fp8's when it is one of an
        fp8 linear layer's three GEMMs (the others' operands are cast inside, as Transformer
        Engine's); every other op at the device's 16-bit figure (they are bandwidth-bound)."""
        if op.kind is not OpKind.EINSUM:
            return DType.BF16
        if op.attrs.get("fp8"):
            return DType.FP8
        return min((self.graph.tensors[i].dtype for i in op.inputs), key=lambda d: d.nbytes)

    def collective(self, name: str, members: list[Op], where: dict[str, int], extra_deps=()) -> int:
        first = members[0]
        axes, collective = first.attrs["axes"], first.attrs["collective"]
        if self.terms is None:  # not tallied: one add for the bucket
            nbytes = sum(self.comm_ev(op.bytes) for op in members)
            add_to(self.stats, "comm_bytes", collective.name, nbytes)
        else:
            nbytes = sum(self._count("comm_bytes", collective.name, op.bytes, comm=True) for op in members)
        self.stats.comm_count[collective.name] += 1
        group = GroupHole(axes, first.attrs.get("members"))
        if not self.keep_nodes:
            self._count_node(NodeType.COMM_COLL_NODE, group)
            where.update(dict.fromkeys(op.outputs[0] for op in members))
            return None
        deps = {p for op in members if (p := self.producer(op.inputs[0], where)) is not None} | set(extra_deps)
        deps.add(self.last_comm)
        node = self._add(
            name=name, type=NodeType.COMM_COLL_NODE, deps=tuple(sorted(d for d in deps if d is not None)),
            collective=collective, comm_bytes=nbytes, group=group,
        )
        self.last_comm = node
        if self.timing:
            self.sized_by[node] = members
        for op in members:
            where[op.outputs[0]] = node
        return node

    def _bucket_name(self, label: str, members: list[Op]) -> str:
        extra = f" +{len(members) - 1}" if len(members) > 1 else ""
        return f"{label} {members[0].name}{extra}"

    def op(self, op: Op, label: str, where: dict[str, int]) -> None:
        if op.kind in VIEWS:
            self.alias[op.outputs[0]] = op.inputs[0]  # a view: no node, same producer
        elif op.kind is OpKind.COLLECTIVE:
            self.collective(f"{label} {op.name}", [op], where)
        else:
            self.compute(op, label, where)

    # -- point to point ----------------------------------------------------------------------
    def _peer(self, stage: int) -> RankHole:
        return RankHole(self.pipeline.stages.rank_and_chunk(stage)[0])

    def _tag(self, edge: Edge, microbatch: int) -> int:
        return microbatch * len(self.pipeline.edges) + edge.index

    def send(self, edge: Edge, microbatch: int, where: dict[str, int]) -> None:
        expr = self.graph.tensors[edge.tensor].nbytes
        nbytes = self._count("send_bytes", None, expr, comm=True)
        if not self.keep_nodes:
            return self._count_node(NodeType.COMM_SEND_NODE, RankHole(), self._peer(edge.target))
        deps = [d for d in (self.producer(edge.tensor, where), self.last_comm) if d is not None]
        self.last_comm = self._add(
            name=f"{microbatch} send {edge.tensor}", type=NodeType.COMM_SEND_NODE, deps=tuple(sorted(set(deps))),
            comm_bytes=nbytes, src=RankHole(), dst=self._peer(edge.target), tag=self._tag(edge, microbatch),
        )
        if self.timing:
            self.sized_by[self.last_comm] = expr

    def recv(self, edge: Edge, microbatch: int, where: dict[str, int]) -> None:
        expr = self.graph.tensors[edge.tensor].nbytes
        nbytes = self._count("recv_bytes", None, expr, comm=True)
        if not self.keep_nodes:
            where[edge.tensor] = None
            return self._count_node(NodeType.COMM_RECV_NODE, self._peer(edge.source), RankHole())
        deps = () if self.last_compute is None else (self.last_compute,)
        where[edge.tensor] = self._add(
            name=f"{microbatch} recv {edge.tensor}", type=NodeType.COMM_RECV_NODE, deps=deps,
            comm_bytes=nbytes, src=self._peer(edge.source), dst=RankHole(), tag=self._tag(edge, microbatch),
        )
        if self.timing:
            self.sized_by[where[edge.tensor]] = expr

    # -- one scheduled action ------------------------------------------------------------------
    def action(self, action: Action, ops: list[Op], units: dict[tuple, list[Op]], where: dict[str, int],
               final: bool = False) -> None:
        """Receive what the action reads from other stages, run its ops, send what other
        stages read of it. Parameter gathers of a unit go out together before its first use,
        one unit ahead of compute (FSDP's prefetch); gradient reductions of a unit together
        once its last gradient is done."""
        stage = virtual_stage(self.rank, action.chunk, self.pipeline.stages.pp)
        label = f"{action.microbatch}{action.kind.value}{action.chunk}"
        self.receive(stage, action.kind, action.microbatch, where)
        self._run_ops(stage, action.kind, ops, units, label, where, final, action.microbatch)
        self.send_made(stage, action.kind, action.microbatch, where)

    def _run_ops(self, stage: int, kind: Kind, ops: list[Op], units: dict, label: str, where: dict, final: bool,
                 microbatch: int) -> None:
        """Run a run's ops, each followed by the gradient buckets it finishes if `final`. Timing
        (an action being recorded): layer by layer, alike layers repeating nodes (_run_alike),
        but for a layer that sends gradient buckets."""
        def run_layer(layer_ops: list[Op]) -> None:
            for op in layer_ops:
                self.run(op, units, label, where)
                for bucket in self.flush_after.get(op.name, []) if final else ():
                    self.collective(self._bucket_name("S", bucket), bucket, where)

        layers = self.run_layers(stage, kind) if self.timing else ()
        if final:
            layers = tuple((None if any(op.name in self.flush_after for op in layer_ops) else key, layer_ops)
                           for key, layer_ops in layers)
        self._run_alike(ops, layers, units, run_layer, where, microbatch)

    def _run_alike(self, ops: list[Op], layers: tuple, units: dict | None, run_layer: Callable[[list[Op]], None],
                   where: dict, microbatch: int) -> None:
        """Run `ops` with `run_layer`, by `layers` ((key, ops) each; key None: no shape) where
        they hold them all (timing: an action or the step being recorded; a short model's block
        stands for several): a layer of the shape of an earlier one (shapes.layer_shape: its ops
        equal but for names) repeats that layer's nodes under its own names (LayerNodes)
        instead of running its ops; the first and last layers run theirs (the first reads what
        came into the stage, a received tensor; what the last makes may leave it, an edge
        tensor)."""
        if not layers or sum(len(layer_ops) for _, layer_ops in layers) != len(ops):
            return run_layer(ops)
        # by layer shape, a layer's nodes that later ones repeat, kept for every recording of
        # the plan (its stages' layers are copies of a few blocks, of its sizes)
        alike: dict[tuple, LayerNodes] = self.ev.layers.setdefault((id(self.sharded), units is None), {})
        for n, (layer_key, layer_ops) in enumerate(layers):
            shape = layer_shape(self, layer_key, layer_ops, units) if layer_key and 0 < n < len(layers) - 1 else None
            if shape is None:
                run_layer(layer_ops)
            elif (earlier := alike.get(shape[0::2])) is None or not earlier.repeat(self, shape[1], layer_ops, where):
                recorded = self._layer_recorded(layer_ops, run_layer, where, microbatch, shape[1])
                if recorded is not None:
                    alike[shape[0::2]] = recorded  # the latest: the next layer follows it

    def _layer_recorded(self, ops: list[Op], run_layer: Callable[[list[Op]], None], where: dict, microbatch: int,
                        names: tuple[str, ...]) -> LayerNodes | None:
        """Run a layer's ops (`names`: its shape's) and record its nodes, with what they add
        to the stats apart (LayerNodes.record)."""
        start, chains, known, stats, terms = len(self.nodes), self.chain_roles(), len(where), self.stats, self.terms
        self.stats, self.terms = ClassStats(), Counter()
        run_layer(ops)
        delta, self.stats, layer_terms, self.terms = self.stats, stats, self.terms, terms
        stats.add(delta)
        if terms is not None:
            add_terms(terms, layer_terms, 1)
        return LayerNodes.record(self, microbatch, start, chains, known, where, delta, layer_terms, names, ops)

    def _edges(self, stage: int, kind: Kind) -> tuple[list[Edge], list[Edge]]:
        """The edges into virtual stage `stage` whose tensors its run of `kind` reads, and the
        edges out of it whose tensors that run makes: found for every run of a stage cut at
        once, from each edge tensor's producer and readers."""
        memo = _run_edges(self.sharded)
        key = (self.pipeline.stages, self.pipeline.split_backward)
        if key not in memo:
            into: dict[tuple, list[Edge]] = {}
            out: dict[tuple, list[Edge]] = {}
            for edge in self.pipeline.edges:  # in order, as each run lists them
                for reader in {_run(op, *key) for op in self.graph.consumers.get(edge.tensor, ())
                               if op.phase is not Phase.STEP}:
                    if reader[0] == edge.target:
                        into.setdefault(reader, []).append(edge)
                maker = self.graph.producer.get(edge.tensor)
                if maker is not None and maker.phase is not Phase.STEP and (run := _run(maker, *key))[0] == edge.source:
                    out.setdefault(run, []).append(edge)
            memo[key] = into, out
        into, out = memo[key]
        return into.get((stage, kind), []), out.get((stage, kind), [])

    @cached_property
    def _edge_tensors(self) -> frozenset[str]:
        return frozenset(edge.tensor for edge in self.pipeline.edges)

    @cached_property
    def _noted(self) -> frozenset[str] | None:
        """Timing: the tensors made by compute nodes whose producers `where` notes -- those a
        later node can look up (what collectives read, through views, and the cut's edge
        tensors, which a receive checks for and a send reads: a compute node depends on the
        compute chain and on comm producers alone) -- so that a repeated action notes a few of the
        hundreds of tensors it makes (ActionNodes.replay). None: every one (a written set's
        nodes, whose lookups this does not narrow)."""
        return _noted_names(self.sharded, self._edge_tensors) if self.timing else None

    def received(self, stage: int, kind: Kind, where: dict):
        """The edges into virtual stage `stage` that its run of `kind` receives: of the tensors
        it reads, those its micro-batch does not hold yet (`where`, checked as each edge comes)."""
        return (edge for edge in self._edges(stage, kind)[0] if edge.tensor not in where)

    def sent(self, stage: int, kind: Kind) -> list[Edge]:
        """The edges out of virtual stage `stage` that carry tensors its run of `kind` makes."""
        return self._edges(stage, kind)[1]

    def receive(self, stage: int, kind: Kind, microbatch: int, where: dict) -> None:
        for edge in self.received(stage, kind, where):
            self.recv(edge, microbatch, where)

    def run(self, op: Op, units: dict[tuple, list[Op]], label: str, where: dict) -> None:
        unit = _unit(op, self.graph)
        members = units.get(unit, ())
        if unit is None:
            self.op(op, label, where)
        elif unit[0] is Role.WEIGHT and op is members[0]:
            self.collective(self._bucket_name(label, members), members, where, [self.prefetch.get(op.phase)])
            self.prefetch[op.phase] = self.last_compute
        elif unit[0] is Role.GRADIENT and op is members[-1]:
            self.collective(self._bucket_name(label, members), members, where)

    def send_made(self, stage: int, kind: Kind, microbatch: int, where: dict) -> None:
        for edge in self.sent(stage, kind):
            self.send(edge, microbatch, where)

    def _tally_action(self, action: Action, units: dict, where: dict, final: bool) -> None:
        """What `action` adds without nodes, from its layers' tallies -- kept per structure: a
        layer's ops and units are the same on whichever stage the cut puts it, so a plan with
        another pp binds them -- and its own receives and sends (the gradient buckets its ops
        finish are counted per plan: _count_actions)."""
        stage = virtual_stage(self.rank, action.chunk, self.pipeline.stages.pp)
        self.receive(stage, action.kind, action.microbatch, where)
        self._add_layers(self.run_layers(stage, action.kind), units, where)
        if final and (stage, action.kind) in self.flushes:  # its gradient buckets: _count_actions counts them
            where.update(dict.fromkeys(op.outputs[0] for op in self._step_plan().reductions[stage, action.kind]))
        self.send_made(stage, action.kind, action.microbatch, where)

    def run_layers(self, stage: int, kind: Kind) -> tuple:
        """The run of virtual stage `stage` and `kind` layer by layer: (its layer key, its ops)
        per layer (_stage_work)."""
        return _stage_work(self.sharded, self.pipeline.stages, self.pipeline.split_backward)[self.rank][3].get(
            (stage, kind), ())

    def _add_layers(self, layers: tuple, units: dict, where: dict, step: bool = False) -> None:
        """Add what an action's ops (or with `step` the optimizer's) add, given layer by layer
        with their keys (_stage_work, _step_layers), each layer's tally kept per structure: a
        layer's ops are the same on whichever stage the cut puts it, so a plan with another pp
        binds them."""
        known = tallies(self.sharded)
        added: dict[int, list] = {}  # id of a tally's terms -> [tally, times] (the copies of a layer share them)
        # of what a layer makes, its micro-batch's later actions only ask for the cut's edge tensors
        # (whether to receive one): those are all `where` needs to hold
        crossing = _crossing_made(self.sharded, self.pipeline.stages, self.pipeline.split_backward)
        edges = self._edge_tensors  # (a plan without a pipeline sends nothing: no crossings to look for)
        may_cross, crossable = (_may_cross(self.sharded.skeleton), _crossable(self.sharded)) if edges else ((), {})
        for key, layer_ops in layers:
            if key not in known:
                known[key] = self._layer_tally(key, layer_ops, units, known, step)
            layer = known[key]
            added.setdefault(id(layer.terms), [layer, 0])[1] += 1
            if key not in crossing:
                if key not in crossable:
                    crossable[key] = tuple(name for name in layer.made if name in may_cross)
                crossing[key] = tuple(name for name in crossable[key] if name in edges)
            if crossing[key]:
                where.update(dict.fromkeys(crossing[key]))
        for layer, times in added.values():  # each distinct tally added once, `times` over
            add_terms(self.terms, layer.terms, times)
            self.stats.add(layer.counts, times)  # its node and collective counts (flops come from the terms)
            self.holes |= layer.holes

    def _layer_tally(self, key: tuple, ops: list[Op], units: dict, known: dict, step: bool) -> ActionTally:
        """The tally of one layer's run of an action's ops (or of its optimizer ops), `key` its
        layer key. A run whose ops have the origins of an earlier one's (ShardedGraph.origins:
        the same ops of two copies of a block) adds what that one adds, and makes its tensors
        under its own names: it is not run again."""
        found = _alike_keys(self.sharded.skeleton)
        alike = found.alike.get(key)
        if alike is None:
            origins = self.sharded.origins_of(ops)
            alike = found.alike[key] = ("alike", step, None if None in origins else
                                        found.numbers.setdefault(origins, len(found.numbers)))
        if alike in known:
            tally, places = known[alike]
            made = found.made.get((key, id(places)))
            if made is None:
                made = found.made[key, id(places)] = tuple(ops[i].outputs[j] for i, j in places)
            return ActionTally(tally.terms, tally.counts, tally.holes, made)
        made: dict = {}

        def run_layer() -> None:
            for op in ops:
                if step:
                    self.op(op, "S", made)
                else:
                    self.run(op, units, "", made)
        tally = self._tallied(run_layer, made)
        place = {out: (i, j) for i, op in enumerate(ops) for j, out in enumerate(op.outputs)}
        if alike[2] is not None and all(name in place for name in tally.made):
            places = tuple(place[name] for name in tally.made)
            known[alike] = tally, found.places.setdefault(places, places)
        return tally

    def _steps_of(self, ops: list[Op], alike: bool = False) -> _BucketSteps:
        """_bucket_steps of a step list of this plan's cut (_step_plans'), once per list; with
        `alike`, that of the first list of the cut that buckets alike (the same kinds, groups and
        byte expressions in order: a pipeline's middle stages'), for what depends on those alone."""
        memo = _bucket_lists(self.sharded, self.pipeline.stages, self.pipeline.split_backward)
        found = memo.get(id(ops))
        if found is None or found[0] is not ops:
            steps = _bucket_steps(self.sharded, ops)
            # (alike lists of every cut: a short model's stages have a cut each, stg/short.py)
            found = memo[id(ops)] = ops, steps, _alike_steps(self.sharded).setdefault(tuple(steps.ops), steps)
        return found[2 if alike else 1]

    def _bucket_starts(self, steps: _BucketSteps, values: tuple[int, ...]) -> list[int]:
        """PyTorch DDP's bucketing: consecutive collectives of one kind, up to bucket_bytes. The
        place of each bucket's first op (a loop of integers over _bucket_steps's list, given the
        values of its expressions)."""
        starts, size, kind, limit = [], 0, -1, self.bucket_bytes
        for place, (unit, _, expr) in enumerate(steps.ops):
            if unit != kind or size >= limit:
                starts.append(place)
                size, kind = 0, unit
            size += values[expr]
        return starts

    def _values(self, steps: _BucketSteps) -> tuple[int, ...]:
        return tuple(map(self.comm_ev, steps.exprs))

    def _per_sizes(self, ops: list[Op], table: str, make: Callable[[_BucketSteps, tuple[int, ...]], tuple],
                   alike: bool = False) -> tuple:
        """make(steps, values) for the step list `ops`, kept in its _BucketSteps `table` per values
        of its byte expressions and bucket size: plans whose sizes agree share it (with `alike`,
        so do the lists that bucket alike, when `make` reads nothing but `steps` and `values`)."""
        steps = self._steps_of(ops, alike)
        values = self._values(steps)
        memo = getattr(steps, table)
        if (values, self.bucket_bytes) not in memo:
            memo[values, self.bucket_bytes] = make(steps, values)
        return memo[values, self.bucket_bytes]

    def buckets(self, ops: list[Op]) -> list[list[Op]]:
        """The step list `ops` cut into gradient buckets."""
        return [ops[start:end] for start, end in pairwise([*self._starts(ops), len(ops)])]

    def _starts(self, ops: list[Op]) -> list[int]:
        """Where the step list `ops`'s buckets start, kept per sizes for every list that buckets
        alike (a pipeline's middle stages')."""
        return self._per_sizes(ops, "starts", self._bucket_starts, alike=True)

    def _action_tally(self, action: Action, units: dict, found: Callable[[], dict], key: tuple) -> ActionTally:
        """An action's tally without nodes -- how many times each expression is added to each
        field, its node counts, and the tensors it makes that a later action of its micro-batch
        may ask for (received, or the cut's edge tensors: _add_layers) -- which holds for every
        plan of this structure and stage cut (a final action's gradient buckets, which the plan's
        sizes cut, are counted apart: _count_actions), so a later plan binds it to its own
        numbers instead of running the ops again."""
        known = tallies(self.sharded)
        shared = (self.pipeline.stages, self.pipeline.split_backward, self.rank, key)
        if shared not in known:  # `found()`: the tensors its micro-batch's earlier actions made
            here = found()
            known[shared] = self._tallied(lambda: self._tally_action(action, units, here, key[2]), here)
        return known[shared]

    def _tallied(self, run, where: dict) -> ActionTally:
        """What `run()` adds, recorded apart from the class's running stats: the terms, node
        and collective counts, holes, and the tensors it adds to `where`."""
        outer, before = (self.stats, self.holes, self.terms), set(where)
        self.stats, self.holes, self.terms = ClassStats(), set(), Counter()
        run()
        tally = ActionTally(self.terms, self.stats, frozenset(self.holes), tuple(t for t in where if t not in before))
        self.stats, self.holes, self.terms = outer
        return tally

    def chain_roles(self) -> dict:
        """The roles before an action other than its micro-batch's tensors: the compute and
        comm chains' last nodes, the compute that the last unit gather of each phase followed."""
        roles = {COMPUTE_ROLE: self.last_compute, COMM_ROLE: self.last_comm}
        roles.update((("prefetch", phase), node) for phase, node in self.prefetch.items())
        return roles

    def present_chains(self) -> frozenset:
        return frozenset(role for role, node in self.chain_roles().items() if node is not None)

    def chains_present(self, present: frozenset) -> bool:
        """Whether the chain roles set now (chain_roles' that are not None) are `present`:
        asked before every repeated action, without making the dict (the roles are distinct,
        so as many, each in `present`, are the same)."""
        count = 0
        if self.last_compute is not None:
            if COMPUTE_ROLE not in present:
                return False
            count = 1
        if self.last_comm is not None:
            if COMM_ROLE not in present:
                return False
            count += 1
        for phase, node in self.prefetch.items():  # (empty but under FSDP)
            if node is not None:
                if ("prefetch", phase) not in present:
                    return False
                count += 1
        return count == len(present)

    def chain_role(self, role: tuple) -> int | None:
        """chain_roles().get(role)."""
        if role[0] == "chain":
            return self.last_compute if role[1] == "compute" else self.last_comm
        return self.prefetch.get(role[1]) if role[0] == "prefetch" else None

    def action_nodes(self, action: Action, ops: list[Op], units: dict, here: dict, key: tuple) -> None:
        """Run an action, or repeat the nodes of the last run action with its key: the same
        nodes, numbered on, under its micro-batch's names and tags, each dependency on what came
        before found by its role (a chain's last node, a tensor's producer), durations rounded
        on the running carry. An action whose roles do not resolve as that one's runs."""
        last = action.microbatch == self.microbatches - 1
        if self.timing and self._last_apart(key[:2]):
            key += (last,)  # what the step reads of the last micro-batch ends runs: see _read_later
        repeat = self.node_repeats.get(key)
        if repeat is not None and repeat.replay(self, action.microbatch, here):
            self._views(key[:2], ops)  # a repeated action runs none of its ops
            return
        if self.timing:  # an alike stage, or another stage, may have run an action of this shape
            moved = self._from_sibling(key, action.kind, action.microbatch, here) if self.sibling else None
            if moved is None:
                shape = shape_of(self, action, ops, units, here, key)
                moved = self._moved(shape, action.microbatch, here) or self._last_apart_of(key, action, here, shape)
            if moved is not None:
                self.templated &= (key, moved.present) not in self.made
                self.node_repeats[key] = self.made[key, moved.present] = moved
                self._views(key[:2], ops)
                return
        # the latest run is the one to repeat: the first ran with empty chains, later ones do not
        self.node_repeats[key] = recorded = self._recorded(
            lambda: self.action(action, ops, units, here, final=key[2]), action.microbatch, here,
            self._read_later(key[:2], last), shape if self.timing else None)
        if self.timing and recorded is not None:
            self.templated &= (key, recorded.present) not in self.made
            self.lowered[key] = self.made[key, recorded.present] = recorded

    def _last_apart_of(self, key: tuple, action: Action, here: dict, shape: tuple) -> ActionNodes | None:
        """Timing: a last micro-batch's action repeated apart (_last_apart) as this stage
        recorded its key's other micro-batches' -- lowering makes the same nodes, only more of
        them end runs (the tensors the step reads) -- kept as a recording is; None (nothing
        added) if there is none or it does not resolve."""
        other = self.lowered.get(key[:4] + (False,)) if key[4:] == (True,) else None
        if other is None:
            return None
        last = other.ending_runs_at(self._read_later(key[:2], True))
        if not last.replay(self, action.microbatch, here):
            return None
        self.stage_templates[(shape[0], last.present)] = self.rebindable[(shape[0], last.present)] = (last, shape)
        return last

    def _moved(self, shape: tuple, microbatch: int, here: dict, reads_all: bool = False) -> ActionNodes | None:
        """Timing: the template another stage of the plan recorded with this shape and chains,
        moved to this stage (shapes.moved_here) and repeated here; None (nothing added) if there
        is none or it does not resolve. Without one, the latest recorded under another plan's
        sizes (of this structure and stage cut), rebound to this plan's."""
        key = (shape[0], self.present_chains())
        found = self.stage_templates.get(key)
        if found is None and (other := self.rebindable.get(key)) is not None:
            found = self.stage_templates[key] = (other[0].rebound(self), other[1])
        moved = moved_here(self, found, shape, reads_all) if found else None
        return moved if moved is not None and moved.replay(self, microbatch, here) else None

    def _recorded(self, run: Callable[[], None], microbatch: int, here: dict, read_later: frozenset[str],
                  shape: tuple | None = None, made_read: bool = True) -> ActionNodes | None:
        """Run `run` (an action, or the step), and record the nodes it made as a template
        (ActionNodes.record: the stats it added, its dependencies by role; without `made_read`,
        no later node reads the tensors it makes, whose names `shape` need not hold); timing:
        add them to the replay and keep the template for the stages whose work has `shape`
        (found before it ran)."""
        flush_compact(self)  # what it runs reads the carry and follows the repeated actions' nodes
        start, chains, known, carry = len(self.nodes), self.chain_roles(), len(here), self.carry
        total, self.stats = self.stats, ClassStats()
        if self.timing:  # the terms its stats add, for other sizes (ActionNodes.rebound)
            self.terms = Counter()
        run()
        delta, self.stats = self.stats, total
        total.add(delta)
        recorded = ActionNodes.record(self, microbatch, start, chains, known, here, delta, read_later)
        if self.timing:
            terms, self.terms = self.terms, None
            if recorded is not None:
                recorded = replace(recorded, tally=ActionTally(terms, delta, frozenset(), ()),
                                   sized_by=tuple(map(self.sized_by.get, range(start, len(self.nodes)))))
        if recorded is not None and not made_read:
            recorded = replace(recorded, exit={role: ref for role, ref in recorded.exit.items() if role[0] != "tensor"})
        if self.timing and recorded is None:
            self._add_to_replay(start)
        elif self.timing:  # its replay nodes as its repeats' are made, from its template
            recorded.pend_recorded(self, start, chains, here)
            self.carry = carry
            # the latest (where the one kept did not move or resolve, this one ran)
            self.stage_templates[(shape[0], recorded.present)] = (recorded, shape)
            self.rebindable[(shape[0], recorded.present)] = (recorded, shape)  # (a plan of other sizes')
        return recorded

    def _views(self, run: tuple, ops: list[Op]) -> None:
        """The views a run's ops make (a view has no node; its producer is the viewed tensor's,
        which the step's collectives look up), noted once per run as running them would (op):
        a stage that only repeats templates of another stage, or of another plan, runs none."""
        if run not in self.viewed:
            self.viewed.add(run)
            self.alias.update((op.outputs[0], op.inputs[0]) for op in ops if op.kind in VIEWS)

    def _read_later(self, run: tuple, last: bool) -> frozenset[str]:
        """The tensors the ops of `run` (a virtual stage and action kind) make that collectives
        of later actions read, directly or through views, and those of the step if `last` (the
        step reads the last micro-batch's): the only later nodes that depend on their producers
        (a COMP node follows the compute chain and its comm inputs; a send goes out in the
        action that made its tensor)."""
        if (run, last) in self.later:  # asked of every action of a timed run
            return self.later[run, last]
        memo = _reads_later(self.sharded)  # a run's ops are its structure's and cut's: kept across plans
        key = (self.pipeline.stages, self.pipeline.split_backward, run, last)
        if key not in memo:
            outside = self._outside(run)
            memo[key] = frozenset(t for _, reads in self._run_reads(run) for t, by_step, others in reads
                                  if (last and by_step) or outside(others))
        self.later[run, last] = memo[key]
        return memo[key]

    def _last_apart(self, run: tuple) -> bool:
        """Whether the step reads more of the run's last micro-batch than later actions read
        of the others' (_read_later): its last action is then repeated apart -- a tensor of the
        run that the step reads and no other run does."""
        apart = self.last_apart.get(run)
        if apart is None:
            memo = _reads_later(self.sharded)
            key = (self.pipeline.stages, self.pipeline.split_backward, run, "apart")
            if key not in memo:
                outside = self._outside(run)
                memo[key] = any(not outside(others) for stepped, _ in self._run_reads(run)
                                for _, _, others in stepped)
            apart = self.last_apart[run] = memo[key]
        return apart

    def apart_runs(self) -> frozenset[tuple]:
        """The stage's runs whose last action is repeated apart (_last_apart)."""
        memo = _reads_later(self.sharded)
        key = (self.pipeline.stages, self.pipeline.split_backward, self.rank, "apart runs")
        if (apart := memo.get(key)) is None:
            order = self.pipeline.order
            runs = ((virtual_stage(self.rank, chunk, order.p), kind) for chunk in range(order.v) for kind in Kind)
            apart = memo[key] = frozenset(run for run in runs if self._last_apart(run))
        return apart

    def _run_reads(self, run: tuple) -> Iterator[tuple[tuple, tuple]]:
        """Per layer of `run`, (the reads of it that the step's collectives make, all its
        reads) as _layer_read gives them, found once per structure."""
        readers, read = _collective_readers(self.sharded), _layer_reads(self.sharded)
        for layer_key, layer_ops in self.run_layers(*run):
            if layer_key not in read:
                reads = tuple(_layer_read(t, op, readers[t]) for op in layer_ops for t in op.outputs if t in readers)
                read[layer_key] = (tuple(r for r in reads if r[1]), reads)
            yield read[layer_key]

    def _outside(self, run: tuple) -> Callable[[tuple], bool]:
        """Whether any of some (layer, phase) readers lies outside `run` in this cut."""
        stages, split = self.pipeline.stages, self.pipeline.split_backward
        return lambda others: any((stages.virtual_stage(layer), _kind(phase, split)) != run for layer, phase in others)

    def _add_to_replay(self, start: int) -> None:
        """The nodes made from `start` on, as the timed replay reads them, each its own run (an
        action that could not be recorded: a recorded one's come from its template)."""
        self.templated = False
        made = self.nodes[start:]
        rows = replay_nodes(made, range(len(made)), start, self.head_of)
        self.replay.add(rows.ids, rows.types, rows.n_deps, rows.deps, rows.durations, rows.comm)
        self.holes.update(hole for node in made if node.type is not NodeType.COMP_NODE for hole in node.holes)

    def plan_gradient_buckets(self) -> None:
        """The step's reductions of gradients the micro-batches make go out in buckets as the
        last backward makes them (PyTorch DDP's overlap): each bucket right after the op that
        finishes its last gradient, in the last action that runs that op. With a pipeline they
        go out after the stage's last action instead (`late_reductions`, in the same order): a
        rank runs one collective or send at a time (the comm chain, as ASTRA-sim does), so a
        bucket inside the backward would hold up the tensor-parallel collectives and the sends
        after it, and in the cool-down each stage would pass that wait on to the stage before
        it -- Llama 3 405B on 16,384 GPUs (tp 8, pp 16, dp 128) lost 1.7 s of an 8 s step
        to 0.16 s of reduce-scatters -- where frameworks run them beside those, on a stream of
        their own."""
        plan = self._step_plan()
        for run, ops in plan.reductions.items():  # each in the order their gradients are finished
            if self.pipeline.stages.pp > 1:
                self.late_reductions.append(ops)
                continue
            if not self.keep_nodes:  # counted, not cut into lists: that the run flushes is all a count reads
                self.flushes[run] = ()
                continue
            def flushed(steps: _BucketSteps, values: tuple[int, ...]) -> tuple[dict, tuple]:
                after: dict[str, list[list[Op]]] = {}  # (shared by plans whose sizes agree: read, never changed)
                for bucket in self.buckets(ops):
                    after.setdefault(plan.made[bucket[-1].name].name, []).append(bucket)
                return after, tuple((name, tuple(map(len, buckets))) for name, buckets in after.items())
            after, self.flushes[run] = self._per_sizes(ops, "flushed", flushed)
            self.flush_after.update(after)

    def step(self, ops: list[Op], where: dict[str, int]) -> None:
        """The gradient buckets a pipeline stage sends after its last action, the optimizer
        (after any reduction it reads that the last backward did not send), then the gathers
        of the new parameters, bucketed."""
        self._late_buckets(where)
        self._optimizer(ops, where)
        self._gathers(where)

    def _late_buckets(self, where: dict[str, int]) -> None:
        for ops in self.late_reductions:
            self._step_buckets(ops, where)

    def _step_buckets(self, ops: list[Op], where: dict[str, int]) -> None:
        """The step's collectives `ops` in buckets, one collective each; without nodes only
        counted, in one pass."""
        if self.keep_nodes:
            for bucket in self.buckets(ops):
                self.collective(self._bucket_name("S", bucket), bucket, where)
            return
        # what collective() counts, without bucket lists: the buckets each group opens (their
        # collectives and nodes) and the bytes per collective
        def counted(steps: _BucketSteps, values: tuple[int, ...]) -> tuple[list, list]:
            opened = Counter(steps.ops[start][1] for start in self._starts(ops))
            return ([(*steps.groups[hole], times) for hole, times in opened.items()],
                    [(name, sum(n * values[expr] for expr, n in times.items())) for name, times in steps.bytes.items()])
        opened, nbytes = self._per_sizes(ops, "opened", counted, alike=True)
        for name, group, times in opened:
            self.stats.comm_count[name] += times
            self._count_node(NodeType.COMM_COLL_NODE, group, times=times)
        for name, total in nbytes:
            self.stats.comm_bytes[name] += total

    def _optimizer(self, ops: list[Op], where: dict[str, int]) -> None:
        def run_layer(layer_ops: list[Op]) -> None:
            for op in layer_ops:
                self.op(op, "S", where)

        self._run_alike(ops, self.step_layers(ops) if self.timing else (), None, run_layer, where, self.microbatches)

    def _gathers(self, where: dict[str, int]) -> None:
        self._step_buckets(self.step_gathers(), where)

    def step_gathers(self) -> list[Op]:
        """The collectives the step sends after its optimizer, to be bucketed."""
        return self._step_plan().deferred

    def step_bucket_lists(self) -> tuple[tuple[list[Op], ...], tuple[tuple[int, ...], ...]]:
        """The step's bucketed lists (late reductions, then the gathers) and where each one's
        buckets start under this plan's sizes: what the step's nodes depend on of the sizes."""
        lists = (*self.late_reductions, self.step_gathers())
        return lists, tuple(tuple(self._starts(steps)) for steps in lists)

    @staticmethod
    def step_layers(ops: list[Op]) -> tuple:
        """The step's optimizer ops layer by layer (_step_layers)."""
        return _step_layers(ops)

    def _step_plan(self) -> _StepPlan:
        return _step_plans(self.sharded, self.pipeline.stages, self.pipeline.split_backward)[self.rank]

    def _count_step(self, ops: list[Op]) -> None:
        """Without nodes: the step's stats. The optimizer's are tallied once per structure and
        stage cut, then bound; the gathers after it, whose buckets the plan's sizes cut, are
        counted as they go."""
        key = ("step", self.pipeline.stages, self.pipeline.split_backward, self.rank)
        known = tallies(self.sharded)
        if key not in known:
            tally = self._tallied(lambda: self._add_layers(_step_layers(ops, self.pipeline.stages), {}, {},
                                                           step=True), {})
            known[key] = alike_tally(known, tally)
        self._late_buckets({})
        self.holes |= known[key].holes
        self.stats.add(self._bound(known[key]))
        self._gathers({})

    def _key(self, stage: int, kind: Kind, last: bool, history: tuple) -> tuple:
        """What an action adds depends only on this key: the tensors it finds made (or
        received) are those of its micro-batch's earlier actions, `history`; the last run of a
        chunk and kind sends the gradient buckets its ops finish (one whose ops finish none is
        like any other, and repeats the others' nodes)."""
        return stage, kind, last and (stage, kind) in self.flushes, history

    def _run_actions(self, actions: list[Action], runs: dict, units: dict) -> dict[int, dict[str, int]]:
        """Run (or repeat) every action's nodes; per micro-batch, the producer of each tensor."""
        pp, finals = self.pipeline.stages.pp, self.pipeline.order.digest(self.rank).finals
        where: dict[int, dict[str, int]] = {}
        for action, stage, history in walked(actions, self.rank, pp):
            key = self._key(stage, action.kind, action in finals, history)
            self.action_nodes(action, runs.get((stage, action.kind), []), units,
                              where.setdefault(action.microbatch, {}), key)
        return where

    def _count_actions(self, units: dict) -> None:
        """Without nodes: the stats of every action, from one tally of the stage's actions kept
        per structure, stage cut and schedule (_stage_tally): a further plan binds it once. The
        gradient buckets that a run's final action sends (without a pipeline) are counted as the
        step's are, per sizes: the plan's sizes cut them, and the tally holds however they are cut."""
        pipeline = self.pipeline
        key = ("stage", pipeline.order, self.rank, pipeline.stages, pipeline.split_backward)
        known = tallies(self.sharded)
        if key not in known:
            known[key] = alike_tally(known, self._stage_tally(units))
        self.holes |= known[key].holes
        self.stats.add(self._bound(known[key]))
        reductions = self._step_plan().reductions
        for run in self.flushes:  # (each run's final action runs once a step)
            self._step_buckets(reductions[run], {})

    def _bound(self, tally: ActionTally) -> ClassStats:
        """tally.bind(...), once per plan for the rank classes whose tallies are alike (a
        pipeline's middle stages: the same layers, each run once per micro-batch; see
        stg.repeats.alike_tally), whose stats are read, never changed."""
        key = (id(tally.terms), id(self.comm_ev))
        found = self.ev.bound.get(key)
        if found is None:
            found = self.ev.bound[key] = tally.bind(self.ev, self.comm_ev)
        return found

    def _stage_tally(self, units: dict) -> ActionTally:
        """The stage's actions' tallies, each added as often as the schedule runs its key. A
        long pipeline runs a million actions of a few keys, and a micro-batch's keys follow from
        the chunks and kinds of its actions in order (and which of them is the last of its chunk
        and kind): each distinct sequence (the stage's walks, stg.schedule.StageDigest) is
        walked once."""
        pp = self.pipeline.stages.pp
        times: Counter = Counter()
        found: dict[tuple, ActionTally] = {}
        for sequence, lasts, count in self.pipeline.order.digest(self.rank).walks:
            earlier = []
            for (action, stage, history), is_last in zip(walked(sequence, self.rank, pp), lasts):
                key = self._key(stage, action.kind, is_last, history)
                if key not in found:  # it finds what its micro-batch's earlier actions made
                    found[key] = self._action_tally(
                        action, units, lambda: dict.fromkeys(n for k in earlier for n in found[k].made), key)
                earlier.append(key)
                times[key] += count
        return combined((found[key], count) for key, count in times.items())

    def build(self) -> list[TraceNode]:
        stages = self.pipeline.stages
        runs, units, step, layers = _stage_work(self.sharded, stages, self.pipeline.split_backward)[self.rank]
        self.plan_gradient_buckets()
        if self.timing and not self.flushes:
            self._alike_stage(layers, units, step)
            wired = self.sibling is not None and wire(self)  # every action and the step repeated, in one loop
            if not wired and self.sibling is not None and self.sibling[1] is None:
                # alike by its blocks, yet not wired: found by its names then, as any stage
                self.sibling, self.sibling_moves = None, {}
                self._alike_stage(layers, units, step, by_blocks=False)
                wired = self.sibling is not None and wire(self)
            if wired:
                return self._built()
            if self.sibling is None:
                self.kept_by = self._stage_key()
                kept = _lowered_stages(self.sharded, stages).get(self.kept_by)
                if kept is not None and wire_own(self, kept):  # as a plan of other sizes lowered it
                    return self._built()
        if self.keep_nodes:
            # the step's views first: a reduction that a degree of 1 turned into a view
            # (stg/passes.py, unit_bound) passes its input's producer on to the reduction after
            # it, which may go out in a bucket after the last backward (without a pipeline) or
            # before the optimizer runs (counting alone reads no producers)
            self._views(("step",), step)
            where = self._run_actions(self.pipeline.schedule[self.rank], runs, units)
        else:
            self._count_actions(units)
            where = {}  # without nodes the step reads no producers
        final: dict[str, int] = {}
        for microbatch in sorted(where):
            final.update(where[microbatch])
        if self.timing:
            self._timed_step(step, final)
        elif self.keep_nodes:
            self.step(step, final)
        else:
            self._count_step(step)
        return self._built()

    def _built(self) -> list[TraceNode]:
        """The stats of the repeated actions added, their nodes flushed; a stage that leaves its
        templates for those alike to it (_alike_stage) leaves them, and a stage lowered action
        by action, every action and the step from a template, leaves them for the next plan
        that lowers it (stg/borrowed.py, wire_own)."""
        for stats, times in self.repeat_stats.values():
            self.stats.add(stats, times)
        flush_compact(self)
        if self.kept_by is not None and self.templated and self.step_template is not None:
            _lowered_stages(self.sharded, self.pipeline.stages).setdefault(
                self.kept_by, StageTemplates(self.made, self.step_template))
        if self.likeness is not None:
            cut, parts, places, first = self.likeness
            repeats = {(self._relative(key), present): nodes for (key, present), nodes in self.made.items()}
            self.stage_templates[cut] = _StageRepeats(self.rank, parts, places, first, repeats, self.step_template)
        return self.nodes

    def _stage_key(self) -> tuple:
        """What a stage's templates depend on but sizes, given its cut: its backward split,
        rank and gradient buckets."""
        return self.pipeline.split_backward, self.rank, self.step_bucket_lists()[1]

    def _alike_stage(self, layers: dict, units: dict, step: list[Op], by_blocks: bool = True) -> None:
        """Timing: find a middle stage of the plan that ran before whose nodes are this one's
        up to names, peers and tags (shapes.stage_likeness), so that this one repeats its
        actions and step moved (_from_sibling) instead of finding each one's shape; else, the
        first middle stage of its cut, note its likeness, under which build leaves its
        templates. (The first and last stages hold the embedding and the output layer.) A stage
        that finds one repeats them all in the sibling's names (stg/borrowed.py) where it can.
        `by_blocks`: a stage that the plan found alike to that stage by its blocks
        (`alike_to`, stg.api._alike_stages) takes it without its likeness, no renaming: its
        edges match the sibling's in order."""
        pp = self.pipeline.stages.pp
        if not 0 < self.rank < pp - 1:
            return
        cut = ("alike stage", tuple((stage // pp, kind, len(run)) for (stage, kind), run in layers.items()),
               len(step), len(self.late_reductions))
        found = self.stage_templates.get(cut)
        if by_blocks and found is not None and found.rank == self.alike_to:
            self.sibling = (found, None)
            return
        parts, names, places, first = stage_likeness(self, layers, units, step)
        if found is None:
            self.likeness = (cut, parts, places, first)
        elif (found.parts, found.places) == (parts, places):
            self.sibling = (found, Renaming(found.first, names))

    def _relative(self, key: tuple) -> tuple:
        """An action key with its virtual stages as chunks: the same on every alike stage."""
        rank_and_chunk = self.pipeline.stages.rank_and_chunk
        return (rank_and_chunk(key[0])[1], key[1], key[2], tuple((rank_and_chunk(s)[1], kind) for s, kind in key[3]),
                *key[4:])

    def _from_sibling(self, key: tuple, kind: Kind, microbatch: int, here: dict) -> ActionNodes | None:
        """Timing: the sibling stage's action of this key (_alike_stage), moved to this stage's
        names, edges and peers and repeated here; None (nothing added) if it has none, an edge
        does not match by name, or it does not resolve."""
        found, rename = self.sibling
        template = found.repeats.get((self._relative(key), self.present_chains()))
        if template is None:
            return None
        moves = self.sibling_moves.get((key[0], kind), False)
        if moves is False:
            moves = self.sibling_moves[key[0], kind] = self._sibling_edges(key[0], kind)
        moved = template.moved(rename, *moves) if moves else None
        return moved if moved is not None and moved.replay(self, microbatch, here) else None

    def _sibling_edges(self, stage: int, kind: Kind) -> tuple[dict, dict] | None:
        """How the sibling's sends and receives of a run move to this stage's (edge_moves);
        None if an edge does not match by name (without a renaming: in order)."""
        found, rename = self.sibling
        theirs, pairs = stage - self.rank + found.rank, []
        # found by blocks (no renaming), the moves are the stage cut's: kept across its plans
        key = (self.pipeline.stages, self.pipeline.split_backward, "moves", found.rank, self.rank, stage, kind)
        memo = _run_edges(self.sharded) if rename is None else {}
        if (moves := memo.get(key, False)) is not False:  # (one lookup: a StagePlan hashes in Python)
            return moves
        for side, end in ((0, "source"), (1, "target")):
            its, mine = self._edges(theirs, kind)[side], self._edges(stage, kind)[side]
            if len(mine) != len(its) or rename is not None and any(
                    old.tensor not in rename or rename[old.tensor] != new.tensor for old, new in zip(its, mine)):
                return None
            pairs += [((old, getattr(old, end)), (new, getattr(new, end))) for old, new in zip(its, mine)]
        moves = memo[key] = edge_moves(self, pairs)
        return moves

    def _timed_step(self, ops: list[Op], where: dict[str, int]) -> None:
        """The step lowered for timing: a stage repeats the step of another stage of the plan
        whose step has its shape (shapes.step_shape: the same layers' optimizers and buckets,
        a pipeline's middle stages'), moved to its names, instead of running its ops."""
        if self.sibling is not None and (template := self.sibling[0].step) is not None:
            moved = template.moved(self.sibling[1], {}, {}, reads_all=True)
            if moved is not None and moved.replay(self, self.microbatches, where):
                self.step_template = moved
                return
        shape = step_shape(self, ops)
        self.step_template = self._moved(shape, self.microbatches, where, reads_all=True)
        if self.step_template is None:
            # nothing runs after the step: its runs end where its nodes say
            self.step_template = self._recorded(lambda: self.step(ops, where), self.microbatches, where,
                                                frozenset(), shape, made_read=False)


@per_graph(limit=16)  # a search meets its plans by structure and cut
def _lowered_stages(sharded: ShardedGraph, stages: StagePlan) -> dict:
    """Per backward split, rank and gradient buckets (_stage_key), the templates a plan of the
    stage cut `stages` lowered each stage with for timing (StageTemplates): the next plan of
    other sizes repeats them all."""
    return {}


@dataclass(frozen=True)
class _StageRepeats:
    """What the first middle stage of a cut leaves for the later ones alike to it
    (_ProgramBuilder._alike_stage): its rank, its likeness (shapes.stage_likeness: parts, the
    place of each name's first use per place and per name), the templates it repeated by
    action key relative to its chunks (_relative) and chains present, and its step's."""

    rank: int
    parts: tuple
    places: list[int]
    first: dict[str, int]
    repeats: dict[tuple, ActionNodes]
    step: ActionNodes | None
    wiring: dict = field(default_factory=dict, compare=False)  # stg/borrowed.py's packed templates


def lower(sharded: ShardedGraph, evaluate: Evaluator, device: DeviceSpec, *, pipeline: Pipeline,
          bucket_bytes: int, rank: int = 0, comm_evaluate: Evaluator | None = None,
          keep_nodes: bool = True, timing: bool = False, stage_templates: dict | None = None,
          rebindable: dict | None = None, alike_to: int | None = None) -> RankProgram:
    """The program of pipeline stage `rank`'s class: its schedule's actions, then the step.
    `comm_evaluate` sizes collectives and sends (default `evaluate`): the values that all
    ranks of a group share, where a class's own work differs (its embedding tables).
    `keep_nodes=False`: the same stats and holes without the node list (stg.evaluate);
    `timing=True`: the same stats and holes and, instead of the nodes, the compact form that the
    timed replay reads (ReplayNodes: what stg explore times); `stage_templates`, with timing: a dict
    that the stages of one plan (one evaluator) share, so that a stage repeats an action
    another stage ran (stage-to-stage the actions differ in names, peers and tags only);
    `rebindable`, with timing: a dict that the plans of one stage cut share, whose templates a
    stage takes with this plan's sizes (the same nodes, other durations and bytes); `alike_to`,
    with timing: an earlier stage whose nodes this one's are up to names, peers and tags, as
    its blocks say (stg.api._alike_stages)."""
    builder = _ProgramBuilder(sharded, evaluate, device, bucket_bytes, pipeline, rank, comm_evaluate,
                              keep_nodes or timing, timing, stage_templates, rebindable, alike_to)
    nodes = builder.build()
    if timing:
        builder.replay.ids = len(builder.nodes)
        return RankProgram((rank,), (), builder.stats, counted_holes=frozenset(builder.holes),
                           timed=builder.replay)
    if keep_nodes:
        return RankProgram((rank,), tuple(nodes), builder.stats)
    return RankProgram((rank,), (), builder.stats, counted_holes=frozenset(builder.holes))
