"""An action's shape: what its nodes depend on but names, peers and tags. Lowered for timing
(stg explore), a pipeline stage repeats an action that another stage of the plan ran with the
same shape, its template moved to this stage's names, edge tags and peers (ActionNodes.moved),
instead of running its ops: stage to stage, a pipeline's actions differ in those only."""

from __future__ import annotations

from typing import TYPE_CHECKING

from stg.blocks import NameTable
from stg.graph import Op
from stg.schedule import Action, virtual_stage
from stg.sharding import ShardedGraph, per_graph

if TYPE_CHECKING:
    from stg.lower import _ProgramBuilder
    from stg.repeats import ActionNodes


class _Alike:
    """Small ints for ops equal but for their names and for tensors equal but for theirs, so
    an action's shape (_action_shape) is a tuple of ints, cheap to hash and to
    compare (its costs are sympy expressions, its kinds enums: both slow to hash in bulk)."""

    def __init__(self) -> None:
        self.ids: dict = {}
        self.names: dict[str, int | None] = {}  # tensor name -> of_tensor's id

    def _id(self, key, value) -> int:
        found = self.ids.get(key)
        if found is None:
            found = self.ids[key] = self.ids.setdefault(("value", value), len(self.ids))
        return found

    def of_op(self, op: Op) -> int:
        found = self.ids.get(op.name)
        if found is None:
            attrs = tuple((k, v) for k, v in op.attrs.items() if k not in _NAMED)
            found = self._id(op.name, (op.kind, op.phase, op.flops, op.bytes, op.label(), attrs))
        return found

    def of_tensor(self, tensor) -> int | None:
        return None if tensor is None else self._id(("tensor", tensor.name), tensor.signature)

    def of_name(self, name: str, tensors) -> int | None:
        """of_tensor(tensors.get(name)), looked up by the name alone once known."""
        found = self.names.get(name, _UNKNOWN)
        if found is _UNKNOWN:
            found = self.names[name] = self.of_tensor(tensors.get(name))
        return found


_UNKNOWN = object()
_NAMED = ("grad_of", "weight")  # attributes that hold names (stg.blocks.NameTable.attrs)


@per_graph
def _alike(sharded: ShardedGraph) -> _Alike:
    return _Alike()


@per_graph
def _shapes(sharded: ShardedGraph) -> dict:
    """Action shapes of a structure, by stage cut and action (shape_of)."""
    return {}


def _named(table: NameTable, op: Op) -> tuple:
    """The places of the names an op's attributes hold."""
    attrs = op.attrs
    if "grad_of" not in attrs and "weight" not in attrs:
        return ()
    return tuple(table.attrs({k: attrs[k] for k in _NAMED if k in attrs}))


def shape_of(builder: _ProgramBuilder, action: Action, ops: list[Op], units: dict, here: dict,
             key: tuple) -> tuple:
    """_action_shape, kept per structure: plans of one stage cut share their stages' runs of
    ops, so the shape of an action with the same key, receives and buckets is the same."""
    stage = key[0]
    received = tuple(edge.index for edge in builder.received(stage, action.kind, here))
    flushes = tuple((name, tuple(tuple(m.name for m in b) for b in builder.flush_after[name]))
                    for name, _ in builder.flushes.get(key[:2], ())) if key[2] else ()
    memo = _shapes(builder.sharded)
    found = memo.get(at := (builder.pipeline.stages, builder.pipeline.split_backward, key, received, flushes))
    if found is None:
        found = memo[at] = _action_shape(builder, action, ops, units, here, key)
    return found


def _action_shape(builder: _ProgramBuilder, action: Action, ops: list[Op], units: dict, here: dict,
                  key: tuple) -> tuple:
    """What an action's nodes depend on but names, peers and tags, with its names in order
    of first use and its sends' and receives' edges: two stages' actions of equal shape
    make the same nodes up to those (timing only; ActionNodes.moved). Its kind, chunk,
    place before or after the last, its micro-batch's earlier actions by chunk and kind; the
    tensors it receives (by place, shape, dtype and role); per layer of its ops the shape of
    that layer's run (layer_shape) and the places of the names the run reads from before
    it; the buckets a final action sends after which of its ops; the tensors it sends (with
    the peer stage of each edge); where its runs end (the tensors later ops read)."""
    table, edges, tensors, same = NameTable(), [], builder.graph.tensors, _alike(builder.sharded)
    at = table.at
    chunk = lambda stage: builder.pipeline.stages.rank_and_chunk(stage)[1]
    parts: list = [(action.kind, action.chunk, key[2:3] + key[4:], tuple((chunk(s), k) for s, k in key[3]))]
    stage = virtual_stage(builder.rank, action.chunk, builder.pipeline.stages.pp)
    for edge in builder.received(stage, action.kind, here):
        parts.append(("recv", at(edge.tensor), same.of_name(edge.tensor, tensors)))
        edges.append((edge, edge.source))
    _layers(builder, at, parts, builder.run_layers(stage, action.kind), units, table)
    if key[2]:  # the gradient buckets a final action sends, after the op that finishes each
        for place, op in enumerate(ops):
            for bucket in builder.flush_after.get(op.name, ()):
                parts.append((place, _bucket(builder, table, at, bucket)))
    for edge in builder.sent(stage, action.kind):
        parts.append(("send", at(edge.tensor), same.of_name(edge.tensor, tensors)))
        edges.append((edge, edge.target))
    last = bool(key[4:]) and key[4]
    parts.append(tuple(sorted(map(at, builder._read_later(key[:2], last)))))  # where its runs end
    return tuple(parts), table.names, edges


def step_shape(builder: _ProgramBuilder, ops: list[Op]) -> tuple:
    """What a stage's step (stg.lower._ProgramBuilder.step) depends on but names, with its
    names in order of first use: the gradient buckets it sends first, its optimizer's ops
    layer by layer (layer_shape, with the places of the names each layer reads from before
    it), the gathers after it; its buckets cut by this plan's sizes. Two stages' steps of
    equal shape make the same nodes up to names (timing only; ActionNodes.moved). Kept per
    structure, stage cut and buckets: the stage's runs, so the views it has noted, are its
    cut's (a search meets a cut's steps once per micro-batch size)."""
    pipeline = builder.pipeline
    key = ("step", pipeline.stages, pipeline.split_backward, builder.rank, builder.step_bucket_lists()[1])
    memo = _shapes(builder.sharded)
    if key not in memo:
        memo[key] = _step_shape(builder, ops)
    return memo[key]


def _step_shape(builder: _ProgramBuilder, ops: list[Op]) -> tuple:
    table, alias, parts = NameTable(), builder.alias, []

    def at(name: str) -> int:
        """Its place, and that of the tensor it views (its nodes depend on that one's producer)."""
        place = table.at(name)
        if name in alias:
            parts.append(("view", place, at(alias[name])))
        return place

    def buckets(kind: str, steps: list[Op]) -> list:
        return [(kind, _bucket(builder, table, at, bucket)) for bucket in builder.buckets(steps)]

    for reductions in builder.late_reductions:
        parts += buckets("late", reductions)
    _layers(builder, at, parts, builder.step_layers(ops), None, table, alias)
    parts += buckets("gather", builder.step_gathers())
    return tuple(parts), table.names, []


def _layers(builder: _ProgramBuilder, at, parts: list, layers: tuple, units: dict | None, table: NameTable,
            alias: dict | None = None) -> None:
    """Add to a shape's `parts` its run's layers ((layer key, ops) each): per layer its
    layer_shape's number and the places (`at`, `table`'s or, with `alias`, one that also
    notes the views among the names) of the names it reads from before it; then every name it
    makes gets its place, where later layers, sends and buckets find it."""
    for layer_key, layer_ops in layers:
        serial, names, outside = layer_shape(builder, layer_key, layer_ops, units)
        parts.append((serial, tuple(map(at, map(names.__getitem__, outside)))))
        if alias and not alias.keys().isdisjoint(names):
            for name in names:
                at(name)
        else:  # what at() does for names that are no views, at once
            table.extend(names)


def _bucket(builder: _ProgramBuilder, table: NameTable, at, bucket: list[Op]) -> tuple:
    """The shape's part for a bucket of collectives: per collective the places (`at`) of what
    it reads and makes, its op, the names its attributes hold, and its input's tensor."""
    same, tensors = _alike(builder.sharded), builder.graph.tensors
    return tuple((at(m.inputs[0]), at(m.outputs[0]), same.of_op(m), _named(table, m), same.of_name(m.inputs[0], tensors))
                 for m in bucket)


def layer_shape(builder: _ProgramBuilder, layer_key: tuple, ops: list[Op],
                units: dict | None) -> tuple[int, tuple, tuple]:
    """A layer's run of an action's ops as its action's shape reads it, kept per structure (a
    layer's ops and coalescing units are the same in every stage cut): a number for what its
    nodes depend on but names (per op its kind, phase, costs, attributes, tensors by place
    with their shape, dtype and role the first time, and coalescing unit), its names in order
    of first use, and the places of those it does not make (its action finds them before it).
    `units` None: a layer of the step's optimizer, whose ops run one by one."""
    memo = _shapes(builder.sharded)
    found = memo.get(layer_key)
    if found is None:
        # the ops of a block's copies (the same origins, ShardedGraph.origins) are alike up to
        # names: a layer alike to one already shaped has its number and outside places, and
        # only its names are walked for
        origins = builder.sharded.origins_of(ops)
        alike = ("alike layer", units is None, origins) if None not in origins else None
        known = memo.get(alike) if alike is not None else None
        table = NameTable()
        if known is not None:
            _walk(builder, ops, units, table, None)
            found = memo[layer_key] = (known[0], tuple(table.names), known[1])
            return found
        parts = _walk(builder, ops, units, table, _alike(builder.sharded))
        made = {name for op in ops for name in op.outputs}
        outside = tuple(place for place, name in enumerate(table.names) if name not in made)
        serials = memo.setdefault(("layer shapes",), {})
        found = memo[layer_key] = (serials.setdefault((tuple(parts), outside), len(serials)), tuple(table.names),
                                   outside)
        if alike is not None:
            memo[alike] = (found[0], outside)
    return found


def _walk(builder: _ProgramBuilder, ops: list[Op], units: dict | None, table: NameTable,
          same: _Alike | None) -> list | None:
    """A layer's run for layer_shape: its names into `table` in order of first use and, with
    `same`, the parts of its shape; without, the names alone (in the same order)."""
    parts, seen, tensors = [], set(), builder.graph.tensors

    def tensor(name: str) -> int:
        """Its place; its tensor's id goes into the shape where the place is first seen."""
        place = table.at(name)
        if same is not None and place not in seen:
            seen.add(place)
            parts.append(same.of_name(name, tensors))
        return place

    def of_op(op: Op) -> int | None:
        return None if same is None else same.of_op(op)

    def collective(op: Op) -> tuple:
        return tensor(op.inputs[0]), tensor(op.outputs[0]), of_op(op), _named(table, op)

    for op in ops:
        unit = builder.unit(op) if units is not None else None
        members = units.get(unit, ()) if unit is not None else ()
        parts.append((of_op(op), _named(table, op), tuple(map(tensor, op.inputs)),
                      tuple(map(tensor, op.outputs)),
                      unit and (unit[0], unit[1], unit[3], unit[4], op is members[0], op is members[-1],
                                tuple(map(collective, members)))))
    return parts if same is not None else None


def moved_here(builder: _ProgramBuilder, found: tuple, shape: tuple, reads_all: bool = False) -> ActionNodes | None:
    """A template another stage recorded, under this stage's names, tags and peers
    (`reads_all`: see ActionNodes.moved)."""
    template, (_, names, edges) = found
    if names == shape[1] and edges == shape[2]:
        # this stage's own, run in a plan of other sizes: nothing to move (and nothing renamed,
        # so a tensor its nodes name that its shape does not, e.g. a received one, still resolves)
        return template
    moves = edge_moves(builder, list(zip(edges, shape[2])))
    return template.moved(dict(zip(names, shape[1])), *moves, reads_all) if moves else None


def edge_moves(builder: _ProgramBuilder, pairs: list[tuple[tuple, tuple]]) -> tuple[dict, dict] | None:
    """How a template's sends and receives move to another stage's edges (ActionNodes.moved):
    the edge indices and the peers, from `pairs` of ((its edge, that edge's peer stage), (the
    new edge, its peer stage)); None where two of its peers would become one (not the same
    pattern)."""
    peers: dict = {}
    for (_, old), (_, new) in pairs:
        if peers.setdefault(builder._peer(old), builder._peer(new)) != builder._peer(new):
            return None
    return {old.index: new.index for (old, _), (new, _) in pairs}, peers


class Renaming:
    """A sibling stage's names -> this stage's (stage_likeness): by the place of each name's
    first use in the sibling's list, the name at that place in this stage's."""

    def __init__(self, first: dict[str, int], names: list[str]) -> None:
        self.first, self.names = first, names

    def __getitem__(self, name: str) -> str:
        return self.names[self.first[name]]

    def __contains__(self, name: str) -> bool:
        return name in self.first


def stage_likeness(builder: _ProgramBuilder, layers_by_run: dict, units: dict,
                   step: list[Op]) -> tuple[tuple, list[str], list[int], dict[str, int]]:
    """What a timed stage's nodes depend on but names, peers and tags, given its plan: per run
    (chunk and kind) its layers' shapes (layer_shape), then its step's layers', and its late
    and gathered buckets' collectives and where each bucket starts; its names in that order
    (each layer's in order of first use); the place of each name's first use, per place; and
    per name. Two stages of equal likeness and places (a pipeline's middle stages) make the
    same nodes up to names, peers and tags, the names matching place by place
    (ActionNodes.moved, Renaming)."""
    buckets, starts = builder.step_bucket_lists()
    memo = _shapes(builder.sharded)  # a stage cut's stage: the same in every plan of its structure and sizes
    key = ("stage likeness", builder.pipeline.stages, builder.pipeline.split_backward, builder.rank, starts)
    if key not in memo:
        memo[key] = _stage_likeness(builder, layers_by_run, units, step, buckets, starts)
    return memo[key]


def _stage_likeness(builder: _ProgramBuilder, layers_by_run: dict, units: dict, step: list[Op], buckets: tuple,
                    starts: tuple) -> tuple[tuple, list[str], list[int], dict[str, int]]:
    same, chunk = _alike(builder.sharded), builder.pipeline.stages.rank_and_chunk
    parts: list = []
    names: list[str] = []
    for (stage, kind), layers in layers_by_run.items():
        serials = []
        for layer_key, layer_ops in layers:
            serial, layer_names, _ = layer_shape(builder, layer_key, layer_ops, units)
            serials.append(serial)
            names += layer_names
        parts.append((chunk(stage)[1], kind, tuple(serials)))
    for layer_key, layer_ops in builder.step_layers(step):
        serial, layer_names, _ = layer_shape(builder, layer_key, layer_ops, None)
        parts.append(serial)
        names += layer_names
    for steps, at in zip(buckets, starts):
        parts.append((at, tuple(map(same.of_op, steps))))
        names += [name for op in steps for name in (op.inputs[0], op.outputs[0])]
    first = dict(zip(reversed(names), range(len(names) - 1, -1, -1)))  # (the earliest place wins)
    return tuple(parts), names, list(map(first.__getitem__, names)), first
