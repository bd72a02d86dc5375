"""The symbolic passes of a plan's structure -- forward graph, autodiff, recompute, sharding --
and, per process, the last few of their results: plans that differ only in degrees, batch
sizes, sequence length, schedule or device share them (issue 12, "build once, bind many")."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

from model_zoo import GraphOptions, Model
from parallelism import sharding_spec
from parallelism.pipeline import retie, tie_copies, tie_gradients, tie_pattern, untie
from stg.autodiff import training_graph
from stg.graph import DType, Graph, OpKind, Role
from stg.plan import OPTIMIZERS, Plan
from stg.recompute import recompute
from stg.sharding import ShardedGraph, local_leaf, op_places, per_graph, recent, shard


@dataclass(frozen=True)
class Structure:
    """What the symbolic passes (forward graph, autodiff, recompute, sharding) depend on: the
    model and the plan's structural choices, not its degrees or sizes, which are bindings.
    `stages` is None unless the model ties weights across blocks: the stage cut matters to
    the passes only through the copies of tied weights (plans of an untied model that differ
    in pp > 1 share one structure)."""

    config: Any
    options: GraphOptions
    stages: Any  # StagePlan or None: which blocks share a stage (tied weights get copies)
    grad_dtype: str | None
    optimizer: Any
    recompute: Any
    spec: Any  # ShardingSpec: which mesh axes split which logical axes

    def training(self) -> tuple[Graph, dict]:
        """The differentiated graph with its optimizer, and the tied weights' copies."""
        forward, ties = Model(self.config, "").forward_graph(self.options), {}
        if self.stages:  # weights read on two stages (tied embeddings) get a copy per stage
            forward, ties = untie(forward, self.stages)
        grad_dtype = DType.parse(self.grad_dtype) if self.grad_dtype else None
        return training_graph(forward, grad_dtype, OPTIMIZERS[self.optimizer]), ties

    def untied(self) -> tuple[ShardedGraph, dict]:
        """The sharded graph before the tied copies' gradients are summed, and the copies."""
        # one training graph per model and options, and one re-run of it per recompute mode
        cached = _hashable(self)
        train, ties = _cached(_TRAINING, self.key()[:5], self.training) if cached else self.training()
        rerun = lambda: recompute(train, self.recompute, last_block=self.config.layers)  # noqa: E731
        return shard(_cached(_RECOMPUTED, self.key()[:6], rerun) if cached else rerun(), self.spec), ties

    def passes(self) -> ShardedGraph:
        if not self.stages:
            return self.untied()[0]
        # a tied model: the passes of another cut with the same tie pattern, its copies renamed
        forward = Model(self.config, "").forward_graph(self.options)
        ties = tie_copies(forward, self.stages)
        pattern_key = (*self.key()[:2], tie_pattern(forward, self.stages), *self.key()[3:])
        sharded, theirs = _cached(_UNTIED, pattern_key, self.untied) if _hashable(self) else self.untied()
        return tie_gradients(retie(sharded, theirs, ties), ties, self.stages)

    def key(self) -> tuple:
        # the spec holds dicts: its printed form is the key (built in a fixed order), printed
        # once (every plan asks for it several times)
        if "_key" not in self.__dict__:
            self.__dict__["_key"] = (self.config, self.options, self.stages, self.grad_dtype, self.optimizer,
                                     self.recompute, repr(self.spec))
        return self.__dict__["_key"]


def _hashable(structure: Structure) -> bool:
    try:
        hash(structure.key())
    except TypeError:
        return False
    return True


def structure_of(model: Model, plan: Plan, options: GraphOptions, stages,
                 widened: frozenset[str] = frozenset()) -> Structure:
    """The structure of `plan` on `model`; `stages` (its cut) only when the cut unties weights;
    `widened`: mesh axes in play even at degree 1 (sharding_spec; bind with unit_bound)."""
    if stages is not None and not tie_copies(model.forward_graph(options), stages):
        stages = None
    return Structure(model.config, options, stages, plan.grad_dtype, plan.optimizer, plan.recompute,
                     sharding_spec(plan, widened))


_TRAINING: dict[tuple, tuple[Graph, dict]] = {}  # differentiated graphs, shared across shardings
_RECOMPUTED: dict[tuple, Graph] = {}  # and with their recomputation (the graphs sharding reads)
_CACHE: dict[tuple, ShardedGraph] = {}
_UNTIED: dict[tuple, tuple[ShardedGraph, dict]] = {}  # a tied model's, per tie pattern (Structure.passes)
_BOUNDS: dict[tuple, ShardedGraph] = {}  # a tied model's without a cut (build's memory bound)
_UNIT_BOUND: dict[tuple, ShardedGraph] = {}  # unit_bound's, per structure and unit axes
_HELD: dict[tuple, Counter] = {}  # held_leaves, per structure
_HELD_ROLES = (Role.WEIGHT, Role.OPTIMIZER_STATE)
_CACHE_SIZE = 16  # sharded graphs of the largest models hold tens of thousands of ops


def _cached(cache: dict, key: tuple, make):
    return recent(cache, key, make, _CACHE_SIZE)


def held_leaves(structure: Structure) -> Counter | None:
    """The local bytes of the structure's weights and optimizer states that its ops read,
    each distinct expression with how many leaves have it, from its training graph and
    sharding spec without the passes (shard() lays a leaf out by the spec alone); None for a
    tied model, whose cut copies its tied weights. Each stage holds the leaves its ops read,
    so one of pp stages holds at least their sum / pp (build refuses a plan from it)."""
    if structure.stages is not None or not _hashable(structure):
        return None

    def count() -> Counter:
        train, _ = _cached(_TRAINING, structure.key()[:5], structure.training)
        held: Counter = Counter()
        local: dict[tuple, object] = {}  # by signature: the layers' leaves share a few
        for name, tensor in train.tensors.items():
            if tensor.role in _HELD_ROLES and name not in train.producer and name in train.consumers:
                if tensor.signature not in local:
                    local[tensor.signature] = local_leaf(structure.spec, tensor).nbytes
                held[local[tensor.signature]] += 1
        return held
    return _cached(_HELD, structure.key(), count)


def passes_cached(structure: Structure) -> bool:
    return _hashable(structure) and structure.key() in _CACHE


def symbolic_passes(structure: Structure) -> ShardedGraph:
    """Structure.passes(), once per structure in a process."""
    return _cached(_CACHE, structure.key(), structure.passes) if _hashable(structure) else structure.passes()


def uncut_passes(structure: Structure) -> ShardedGraph | None:
    """A tied structure's passes without its stage cut, so without the copies of its tied
    weights (one graph for every cut), for a bound on its memory; None where there is nothing
    to gain (no cut, or its own passes are cached). Kept apart, so that the cuts' and the
    folds' structures (stg/explore/probe.py) do not push the few of them out."""
    if structure.stages is None or not _hashable(structure) or structure.key() in _CACHE:
        return None
    uncut = replace(structure, stages=None)
    key = uncut.key()
    return _CACHE[key] if key in _CACHE else _cached(_BOUNDS, key, uncut.passes)


@per_graph
def _collectives_by_axes(sharded: ShardedGraph) -> tuple[dict[tuple, list[int]], dict[str, tuple[int, ...]], dict]:
    """The places of the graph's collectives by the mesh axes they run over; of the tensors
    they read, the places of every op that reads it; and (filled by unit_bound) per those axes
    and the axes a binding keeps of them, the changed ops, the tensors they read and make:
    what unit_bound changes and re-lists, found once for every set of unit axes."""
    graph, places = sharded.graph, op_places(sharded)
    by_axes: dict[tuple, list[int]] = {}
    for place in places.collectives:
        by_axes.setdefault(graph.ops[place].attrs["axes"], []).append(place)
    readers = {name: tuple(places.place[user.name] for user in graph.consumers[name])
               for place in places.collectives for name in graph.ops[place].inputs}
    return by_axes, readers, {}


def _bound_op(op, kept: tuple[str, ...]):
    """A collective bound to the axes it keeps: a view when it keeps none."""
    return op.changed(attrs={**op.attrs, "axes": kept}) if kept else op.changed(kind=OpKind.CONSTRAIN)


def unit_bound(structure: Structure, units: frozenset[str]) -> ShardedGraph:
    """The structure's passes as a plan runs them whose degree is 1 on each of `units`, axes
    the structure has in play (widened: plans of degree 1 and above share one structure, and
    with it the passes and the analyses of memory, checks and pipeline cut, which hold alike
    at degree 1). A collective over those axes alone moves nothing and becomes a view (no
    node, no bytes: Megatron's mappings return their input when the group has one rank);
    another leaves them out of its group. Every tensor keeps its name and size."""
    sharded = symbolic_passes(structure)

    def bind() -> ShardedGraph:
        graph, (by_axes, readers, changes) = sharded.graph, _collectives_by_axes(sharded)
        # its ops, producers and consumers are the structure's with the changed ops swapped in
        # (the maps of tens of thousands of ops, shared by every plan of the structure; a
        # collective changes alike under every binding that keeps the same of its axes)
        ops, producer, consumers, read = list(graph.ops), dict(graph.producer), dict(graph.consumers), set()
        for axes, places in by_axes.items():
            if units.isdisjoint(axes):
                continue
            kept = tuple(axis for axis in axes if axis not in units)
            if (axes, kept) not in changes:
                changed = [_bound_op(graph.ops[place], kept) for place in places]
                changes[axes, kept] = (changed, {name for op in changed for name in op.inputs},
                                       [(name, op) for op in changed for name in op.outputs])
            changed, reads, made = changes[axes, kept]
            for place, op in zip(places, changed):
                ops[place] = op
            producer.update(made)
            read |= reads
        for name in read:  # each read tensor once
            consumers[name] = tuple(map(ops.__getitem__, readers[name]))
        bound = Graph(graph.tensors, tuple(ops))
        bound.__dict__.update(producer=producer, consumers=consumers)
        return replace(sharded, graph=bound, mesh_axes=tuple(axis for axis in sharded.mesh_axes if axis not in units),
                       base=sharded)
    return _cached(_UNIT_BOUND, (structure.key(), units), bind) if _hashable(structure) else bind()
