"""Layout propagation: from a training graph and logical-axis rules to the sharded graph.

Leaves (inputs, weights, optimizer states) get their layouts from the rules (logical axis ->
mesh axes). Then each op, in program order, states the layouts it needs of its inputs and the
layouts of its outputs (stg/op_layouts.py, one rule per op kind). Where a tensor's layout differs
from what its consumer needs, stg/redistribute.py plans the collectives and they enter the
graph as COLLECTIVE ops. Policy on a conflict: weights are stationary, activations move.

The result holds *local* shapes (`B/dp`), so every op's FLOPs and bytes, and every collective's
size, are recomputed from what one rank holds: right by construction.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field
from itertools import accumulate, islice, repeat
from operator import attrgetter
from typing import Any, Callable, Mapping, Sequence

from stg.blocks import NameTable, blocks, renaming, signature_of
from stg.builder import GraphBuilder
from stg.graph import Graph, Op, OpKind, Phase, Role, Tensor
from stg.mesh import FLAT, REPLICATED, Layout, Placement, Shard
from stg.op_layouts import RULES, anchors_read, project, unflattened
from stg.redistribute import Collective, plan_redistribution


@dataclass(frozen=True)
class LayoutRules:
    """Logical axis -> the mesh axes that split it; `flat` mesh axes split the flattened
    tensor (ZeRO / FSDP). A mesh axis splits at most one dimension."""

    split: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    flat: tuple[str, ...] = ()

    def layout(self, tensor: Tensor, mesh_axes: Sequence[str]) -> Layout:
        key = (tensor.dims, tuple(mesh_axes))  # the leaves of every block copy ask for the same few
        found = self._layouts.get(key)
        if found is None:
            found = self._layouts[key] = self._layout(tensor.dims, key[1])
        return found

    @functools.cached_property
    def _layouts(self) -> dict[tuple, Layout]:
        return {}

    def axes(self) -> set[str]:
        """The mesh axes these rules name."""
        return {axis for axes in self.split.values() for axis in axes} | set(self.flat)

    def _layout(self, dims: tuple[str, ...], mesh_axes: tuple[str, ...]) -> Layout:
        placements: dict[str, Placement] = {}
        for dim, logical in enumerate(dims):
            for axis in self.split.get(logical, ()):
                if axis in mesh_axes and axis not in placements:
                    placements[axis] = Shard(dim)
        for axis in self.flat:
            if axis in mesh_axes and axis not in placements:
                placements[axis] = Shard(FLAT)
        return Layout.of(placements, mesh_axes)


@dataclass(frozen=True)
class ShardingSpec:
    """What a plan asks of the sharding pass: layouts of the leaves, and of each anchor tag."""

    mesh_axes: tuple[str, ...]  # the mesh axes in play (size > 1), in mesh order
    params: LayoutRules = LayoutRules()  # weights as stored
    states: LayoutRules = LayoutRules()  # optimizer states
    data: LayoutRules = LayoutRules()  # inputs: tokens, labels, positions
    anchors: Mapping[str, LayoutRules] = field(default_factory=dict)  # CONSTRAIN tag -> rules

    def leaf_rules(self, tensor: Tensor) -> LayoutRules:
        return self.role_rules(tensor.role)

    def role_rules(self, role: Role) -> LayoutRules:
        """The rules that lay out the leaves of `role`."""
        return {Role.WEIGHT: self.params, Role.OPTIMIZER_STATE: self.states}.get(role, self.data)

    def leaf_layout(self, tensor: Tensor) -> Layout:
        """A leaf's layout (a weight, an optimizer state, an input): the spec alone decides it."""
        return self.leaf_rules(tensor).layout(tensor, self.mesh_axes)


@dataclass(frozen=True)
class ShardedGraph:
    graph: Graph  # local shapes, collectives inserted
    layouts: Mapping[str, Layout]  # every tensor's layout on the mesh
    global_tensors: Mapping[str, Tensor]  # every tensor's global shape
    mesh_axes: tuple[str, ...]
    # op -> (its block's template, its place in it): two ops of one origin are one op of two
    # copies of a block, alike up to names (what a lowering may tally once for both)
    origins: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    # the graph whose ops this one has place by place -- the same names, layers and phases,
    # some collectives bound to fewer axes or to views (stg/passes.py, unit_bound) -- or None
    base: ShardedGraph | None = None

    def describe(self, tensor: str) -> str:
        return self.layouts[tensor].describe(self.global_tensors[tensor].shape)

    @property
    def skeleton(self) -> ShardedGraph:
        """The graph that what depends only on the ops' places, names, layers and phases is
        found on once, for every graph bound from it."""
        return self if self.base is None else self.base

    def origins_of(self, ops: Sequence[Op]) -> tuple[tuple[int, int] | None, ...]:
        """Each op's origin (None: it has none): runs of ops with equal origins are alike up to
        names, what a lowering tallies or shapes once for all of them."""
        return tuple(map(self.origins.get, map(_NAME, ops)))


_NAME = attrgetter("name")


class _Sharder:
    def __init__(self, graph: Graph, spec: ShardingSpec):
        self.src = graph
        self.spec = spec
        self.mesh_axes = spec.mesh_axes
        self.layouts: dict[str, Layout] = {}
        self.global_tensors: dict[str, Tensor] = {}
        self.g = GraphBuilder()
        self.rebound: dict[str, str] = {}  # a tensor -> the copy its consumers read instead
        self.memo: dict[tuple, str] = {}  # (tensor, layout, phase group or None) -> redistributed copy
        self.copies: dict[str, list[tuple[Layout, str | None]]] = {}  # tensor -> its copies' keys
        self.derived: dict[str, tuple[str, str]] = {}  # a copy -> (the tensor it copies, its name's suffix)
        self.changes: list[tuple] = []  # every write to memo, copies and rebound, in order
        self.templates: dict[tuple, _Template] = {}  # a block's signature -> how it was sharded
        self.origins: dict[str, tuple[int, int]] = {}  # ShardedGraph.origins
        self.marks: list[tuple[int, ...]] = []  # the sizes of the tables above before each block (_Donor)
        self.resumed = 0  # blocks taken from another sharding of the graph (resume)

    def tensor(self, name: str) -> Tensor:
        return self.global_tensors[name]

    def define(self, tensor: Tensor, layout: Layout, local: Tensor | None = None) -> None:
        """`tensor` laid out as `layout`; `local`: one rank's part, when known."""
        self.global_tensors[tensor.name] = tensor
        self.layouts[tensor.name] = layout
        self.g.tensors[tensor.name] = local or _shaped(tensor, tensor.name, layout.local_shape(tensor.shape))

    def run(self, templates: bool = True) -> ShardedGraph:
        # the leaves of a block's copies differ in name only: each kind laid out once, all
        # defined at once (tens of thousands of weights and optimizer states)
        leaves, (names, firsts, kind_of) = _leaves(self.src), _leaf_kinds(self.src)
        kinds = [(layout := self.spec.leaf_layout(tensor),
                  _sized(_shaped(tensor, tensor.name, layout.local_shape(tensor.shape)))) for tensor in firsts]
        layouts, locals_ = zip(*map(kinds.__getitem__, kind_of)) if leaves else ((), ())
        self.global_tensors.update(zip(names, leaves))
        self.layouts.update(zip(names, layouts))
        self.g.tensors.update(zip(names, map(Tensor.renamed, locals_, names)))
        for block in _block_bodies(self.src)[self.resume() if templates else 0:]:
            self.marks.append(self.mark())
            if templates:
                self.shard_block(*block)
            else:
                for op in block[0]:
                    self.shard_op(op)
        self.marks.append(self.mark())
        sharded = ShardedGraph(self.g.build(), self.layouts, self.global_tensors, self.mesh_axes, self.origins)
        if templates:
            _DONATED[:] = [*_DONATED[1 - _DONORS:], _Donor(self.src, self.spec, sharded, self.changes, self.derived,
                                                           self.templates, self.marks)]
        return sharded

    def mark(self) -> tuple[int, ...]:
        """How long each table is: every one only grows from block to block (a name is made
        once; the memo, copies and rebound copies are the `changes` replayed)."""
        return (len(self.layouts), len(self.global_tensors), len(self.g.tensors), len(self.g.ops), len(self.changes),
                len(self.derived), len(self.templates), len(self.origins))

    def resume(self) -> int:
        """Take the first blocks of a recent sharding (the most of them among _DONATED) as they
        are: the blocks its graph has alike with this one (all, or a recomputation's forward,
        _common_blocks) up to the first that reads a leaf the two specs lay out otherwise, or
        an anchor whose rules differ, shard alike under both (a block's work depends on the spec
        only through those, and on the blocks before it). Plans that differ in their ZeRO stage
        share the forward (and ZeRO-0 and 1 the backward), plans that differ in recomputation the
        forward. The tables are the donor's cut at that block's mark, after this spec's own
        leaves. How many blocks."""
        reads, start, donor = _spec_reads(self.src), 0, None
        for other in _DONATED:
            if other.spec.mesh_axes != self.mesh_axes:
                continue
            alike = reads if other.graph is self.src else reads[:_common_blocks(other.graph, self.src)]
            if (agree := _agreeing(other.spec, self.spec, alike)) > start:
                start, donor = agree, other
        if donor is None:
            return 0
        layouts, globals_, tensors, ops, changes, derived, templates, origins = donor.marks[start]
        leaves = len(self.layouts)  # the donor's leaves come first too, in the same order
        assert donor.marks[0][:3] == (leaves,) * 3
        self.layouts.update(islice(donor.sharded.layouts.items(), leaves, layouts))
        self.global_tensors.update(islice(donor.sharded.global_tensors.items(), leaves, globals_))
        self.g.add_costed(donor.sharded.graph.ops[:ops], islice(donor.sharded.graph.tensors.items(), leaves, tensors))
        self.apply_all(islice(donor.changes, changes))
        self.derived.update(islice(donor.derived.items(), derived))
        self.templates.update(islice(donor.templates.items(), templates))
        self.origins.update(islice(donor.sharded.origins.items(), origins))
        self.marks, self.resumed = donor.marks[:start], start
        return start

    def shard_block(self, ops: list[Op], table: NameTable, body: int | None, outside: tuple[str, ...]) -> None:
        """Shard one block's ops (a run of one layer), or replay how a block with the same
        signature was sharded, under its own names: of a model's repeated blocks, each distinct one
        costs its ops, the others their names."""
        names, key = self.signature(table.copy(), body, outside)
        template = self.templates.get(key) if key is not None else None
        if template is not None and self.replay(template, names, ops):
            return
        first_op, first_change = len(self.g.ops), len(self.changes)
        for op in ops:
            self.shard_op(op)
        if key is not None:
            added = self.g.ops[first_op:]
            made = tuple(out for op in added for out in op.outputs)
            template = self.templates[key] = _Template(
                len(self.templates), names, added, self.changes[first_change:], made,
                tuple(map(self.layouts.__getitem__, made)), tuple(map(self.g.tensors.__getitem__, made)),
                _columns([(place, self.global_tensors[name], *self.derived[name])
                          for place, name in enumerate(made) if name in self.derived], 4))
            self.origins.update((op.name, (template.serial, place)) for place, op in enumerate(template.ops))

    def shard_op(self, op: Op) -> None:
        names = [self.rebound.get(i, i) for i in op.inputs]
        ins = [self.tensor(i) for i in names]
        outs = [self.src.tensors[o] for o in op.outputs]
        lays = [self.layouts[i] for i in names]
        if op.kind not in (OpKind.OPTIMIZER, OpKind.CONSTRAIN):
            lays = [unflattened(layout) for layout in lays]
        needed, produced = RULES[op.kind](op, ins, lays, outs, self)
        inputs = tuple(self.redistribute(name, layout, op) for name, layout in zip(names, needed))
        for tensor, layout in zip(outs, produced):
            self.define(tensor, layout)
        local_outs = [self.g.tensors.pop(o.name) for o in outs]  # add_op registers them again
        self.g.add_op(op.name, op.kind, inputs, local_outs, dict(op.attrs), phase=op.phase, layer=op.layer)
        self.reduce_final_gradients(op)

    def signature(self, table: NameTable, body: int | None, outside: tuple[str, ...]) -> tuple[list[str], tuple | None]:
        """The names a block reads and writes (in order of first use), and everything that
        sharding it reads, with names replaced by their place in that list: its ops and the
        tensors they make (`body`, _block_bodies), and the state of each name made before it
        (`outside`, then the rebound and earlier copies it names: shape, layout, rebound copy,
        copies made). Two blocks with one signature shard alike up to names. None: an
        attribute is no key."""
        at, state, names = table.at, [], table.names
        base = len(names)

        rebound_of, copies_of, tensor_of, layout_of, memo = (self.rebound.get, self.copies.get, self.global_tensors.get,
                                                             self.layouts.get, self.memo)

        def state_of(name: str) -> tuple:  # (asked of every name every block copy reads)
            rebound, listed = rebound_of(name), copies_of(name)
            copies = () if listed is None else tuple(
                (layout, group, at(memo[(name, layout, group)])) for layout, group in listed)
            return (signature_of(tensor_of(name)), layout_of(name), None if rebound is None else at(rebound), copies)

        state.extend(map(state_of, outside))
        for name in islice(names, base, None):  # grows as rebound copies and earlier copies are named
            state.append(state_of(name))
        if body is None:
            return names, None
        return names, (body, tuple(state))

    def replay(self, template: _Template, names: list[str], ops: list[Op]) -> bool:
        """Add `template`'s ops and state under this block's names; False (nothing changed)
        when a name it would make exists already. Thousands of ops per structure: the names
        are mapped list by list, and the sharder's tables updated a block at a time."""
        rename = renaming(template.names, names, template.made, self.derived)
        at = rename.__getitem__
        made = list(map(at, template.made))
        if not self.layouts.keys().isdisjoint(made):
            return False
        self.layouts.update(zip(made, template.layouts))
        # a source op's outputs are the source graph's tensors; a copy's (a collective's or a
        # slice's) its template's renamed, written over in place so that the order is kept
        self.global_tensors.update(zip(made, map(self.src.tensors.get, made)))
        places, globals_, bases, suffixes = template.copied
        copied = [made[place] for place in places]
        self.global_tensors.update(zip(copied, map(Tensor.renamed, globals_, copied)))
        self.derived.update(zip(copied, zip(map(at, bases), suffixes)))
        op_names, read = list(map(at, template.op_names)), list(map(at, template.reads))
        inputs = map(tuple, map(read.__getitem__, template.inputs))
        outputs = map(tuple, map(made.__getitem__, template.outputs))
        # a source op's attributes are its own (names in them); no pass changes an op's attributes,
        # so a copy shares them
        sources = map(attrgetter("attrs"), ops)
        attrs = [next(sources) if own is None else own for own in template.own_attrs]
        copies = list(map(Op.renamed, template.ops, op_names, inputs, outputs, repeat(ops[0].layer), attrs))
        self.g.add_costed(copies, zip(made, map(Tensor.renamed, template.locals, made)))
        self.origins.update(zip(op_names, template.places))
        self.apply_all(template.changes, at)
        return True

    def apply_all(self, changes: list[tuple], at=str) -> None:
        """Write to the memo, the copies and the rebound copies, in order, and record the writes
        (`changes`): a block's own, or recorded ones again with their names mapped by `at` (a
        replayed block's renaming; `str` keeps them)."""
        memo, copies, rebound, mapped = self.memo, self.copies, self.rebound, []
        for kind, first, second in changes:
            if kind == "memo":
                name, layout, group = first
                change = (kind, (at(name), layout, group), at(second))
                memo[change[1]] = change[2]
                copies.setdefault(change[1][0], []).append((layout, group))
            else:
                change = (kind, at(first), at(second))
                rebound[change[1]] = change[2]
            mapped.append(change)
        self.changes += mapped

    def remember(self, name: str, layout: Layout, group: str | None, result: str) -> None:
        self.apply_all([("memo", (name, layout, group), result)])

    def rebind(self, name: str, copy: str) -> None:
        self.apply_all([("rebound", name, copy)])

    def reduce_final_gradients(self, op: Op) -> None:
        """An activation's gradient that comes out as a partial sum over an axis that splits its
        tensor, and is not one of several contributions still to be added, is reduce-scattered
        at once to its tensor's split (DTensor's rule: a gradient is placed like its tensor),
        so the ops after it run on shards --
        context parallelism's dK and dV are reduce-scattered where they are made, as in
        Llama 3. Contributions are summed first and reduced once (Megatron's fused QKV), and
        weight gradients wait for their anchor (data parallelism syncs them once per step)."""
        for out, target in zip(op.outputs, op.attrs.get("grad_of", ())):
            tensor, forward = self.src.tensors[out], self.layouts.get(target)
            if tensor.role is not Role.ACTIVATION or forward is None or not self.layouts[out].partial_axes:
                continue
            if any(user.attrs.get("grad_of") == (target,) and user.kind is OpKind.POINTWISE
                   for user in self.src.consumers.get(out, ())):
                continue
            # only onto a split of the tensor (a reduce-scatter: less work after it); a partial
            # sum over an axis the tensor is whole on goes on to the weight gradients as it is
            split = project(unflattened(forward), self.tensor(target), tensor).as_dict()
            current = self.layouts[out].as_dict()
            scatter = {ax: split[ax] for ax in self.layouts[out].partial_axes if isinstance(split.get(ax), Shard)}
            if scatter:
                self.rebind(out, self.redistribute(out, Layout.of({**current, **scatter}, self.mesh_axes), op))

    def reduced_layout(self, name: str, phase: Phase) -> Layout | None:
        """The layout of a copy of `name` with its partial sums reduced, if one was made."""
        for layout, group in self.copies.get(name, ()):
            if not layout.partial_axes and group in (None, _phase_group(phase)):
                return layout
        return None

    def redistribute(self, name: str, layout: Layout, consumer: Op) -> str:
        current = self.layouts[name]
        if current == layout:
            return name
        tensor = self.tensor(name)
        steps = plan_redistribution(name, tensor.shape, current, layout, self.mesh_axes)
        # A gathered copy is redundant memory: the backward gathers again rather than keep it
        # (Megatron's sequence parallel, FSDP's parameters). A reduced value is unique: kept;
        # so is distributed input data (TorchRec keeps the routed ids and lengths), and so are
        # routed tokens (an all-to-all first: Megatron-Core's experts keep the tokens they got,
        # gathered over tp with etp > 1, for their weight gradients).
        collectives = {step.collective for step in steps}
        gathers = (Collective.ALL_GATHER in collectives and Collective.ALL_TO_ALL not in collectives
                   and tensor.role is not Role.INPUT)
        phase_group = _phase_group(consumer.phase)
        key = (name, layout, phase_group if gathers else None)
        if key in self.memo:
            return self.memo[key]
        result = name
        for step in steps:
            kind = "slice" if step.collective is None else step.collective.name.lower()
            out_name = f"{name}.{kind}[{','.join(step.axes)}]" + ("" if phase_group == "F" else f".{phase_group}")
            while out_name in self.layouts:  # the same tensor brought to another layout
                out_name += "'"
            self.global_tensors[out_name] = tensor.renamed(out_name)
            self.layouts[out_name] = step.layout
            self.derived[out_name] = (name, out_name[len(name):])
            attrs = {"detail": kind, "axes": step.axes}
            if step.collective is not None:
                attrs["collective"] = step.collective
            op_kind = OpKind.COLLECTIVE if step.collective is not None else OpKind.SLICE
            local = _shaped(tensor, out_name, step.after)
            self.g.add_op(out_name, op_kind, (result,), [local], attrs, phase=consumer.phase, layer=consumer.layer)
            result = out_name
        self.remember(name, layout, key[2], result)
        return result


@dataclass(frozen=True)
class _Template:
    """How one block was sharded: the names its signature lists, the ops it added (sources
    and collectives) and its writes to the sharder's memo and rebound copies; and per name
    its ops make, in order, the sharder's layout and local tensor of it, and for a copy's
    (ShardedGraph's `derived`) its global tensor, base name and suffix."""

    serial: int  # its place among the sharder's templates
    names: list[str]
    ops: list[Op]
    changes: list[tuple]
    made: tuple[str, ...]
    layouts: tuple[Layout, ...]
    locals: tuple[Tensor, ...]
    # of the names a copy makes: their places in `made`, global tensors, base names and suffixes
    copied: tuple[tuple[int, ...], tuple[Tensor, ...], tuple[str, ...], tuple[str, ...]]

    def __post_init__(self) -> None:
        for local in self.locals:
            _sized(local)

    @functools.cached_property
    def own_attrs(self) -> tuple[Mapping | None, ...]:
        """Per op, the attributes of an op the sharding pass added (a collective or a slice);
        None for a source op's, which each copy takes from its own source op."""
        return tuple(op.attrs if op.kind in (OpKind.COLLECTIVE, OpKind.SLICE) else None for op in self.ops)

    @functools.cached_property
    def op_names(self) -> tuple[str, ...]:
        return tuple(op.name for op in self.ops)

    @functools.cached_property
    def reads(self) -> tuple[str, ...]:
        """Every op's inputs, one after another (`inputs` slices them per op)."""
        return tuple(name for op in self.ops for name in op.inputs)

    @functools.cached_property
    def inputs(self) -> tuple[slice, ...]:
        """Per op, its inputs' places in `reads`."""
        return _slices(len(op.inputs) for op in self.ops)

    @functools.cached_property
    def outputs(self) -> tuple[slice, ...]:
        """Per op, its outputs' places in `made`."""
        return _slices(len(op.outputs) for op in self.ops)

    @functools.cached_property
    def places(self) -> tuple[tuple[int, int], ...]:
        """Each op's ShardedGraph.origins entry."""
        return tuple((self.serial, place) for place in range(len(self.ops)))


def _columns(rows: list[tuple], width: int) -> tuple[tuple, ...]:
    """`rows` as `width` columns."""
    return tuple(map(tuple, zip(*rows))) if rows else ((),) * width


def _slices(lengths) -> tuple[slice, ...]:
    """Consecutive slices of these lengths."""
    ends = list(accumulate(lengths))
    return tuple(map(slice, [0, *ends[:-1]], ends))


def local_leaf(spec: ShardingSpec, tensor: Tensor) -> Tensor:
    """A leaf as one rank holds it in the graph that shard() makes."""
    if not spec.mesh_axes:
        return tensor
    return _shaped(tensor, tensor.name, spec.leaf_layout(tensor).local_shape(tensor.shape))


def _shaped(tensor: Tensor, name: str, shape: tuple) -> Tensor:
    """`tensor` under `name` with `shape` (dataclasses.replace costs ten times as much)."""
    return Tensor(name, shape, tensor.dims, tensor.dtype, tensor.role, tensor.transient)


def _sized(tensor: Tensor) -> Tensor:
    """`tensor` with its bytes worked out once: the copies made of it (Tensor.renamed) keep
    them, so the many copies of a block's tensors are not sized one by one (memory's index
    reads every leaf's and every saved activation's)."""
    tensor.nbytes  # noqa: B018 (a cached property: computed here, kept)
    return tensor


def _phase_group(phase: Phase) -> str:
    return {Phase.FORWARD: "F", Phase.STEP: "S"}.get(phase, "B")


# per_graph's limit for what is kept per stage cut: a plan on a short model reads one cut per
# pipeline stage (stg/short.py), and the plans of one cut come together (stg.evaluate)
CUT_LIMIT = 64


def per_graph(fn=None, *, limit: int = 8):
    """Memoise fn(sharded, *args) on the graph object itself (a ShardedGraph is never mutated)
    and the other, hashable, arguments: what a pass reads of a structure is gathered once,
    however many plans bind it. Keeps at most `limit` results (any immutable object with an
    identity can be the first argument)."""
    if fn is None:
        return functools.partial(per_graph, limit=limit)
    memo: dict[tuple, tuple] = {}

    @functools.wraps(fn)
    def wrapper(sharded, *args):
        key = (id(sharded), *args)
        hit = recent(memo, key, lambda: (sharded, fn(sharded, *args)), limit)
        if hit[0] is not sharded:  # a graph gone, whose id this one reuses
            hit = memo[key] = (sharded, fn(sharded, *args))
        return hit[1]
    return wrapper


@dataclass(frozen=True)
class OpPlaces:
    """Where a graph's ops stand: each op's place by name, and the places of its collectives
    (of its step's apart), which a graph bound from it (ShardedGraph.base) keeps or turns
    into views."""

    place: Mapping[str, int]
    collectives: tuple[int, ...]
    step_collectives: tuple[int, ...]


@per_graph
def op_places(skeleton: ShardedGraph) -> OpPlaces:
    ops = skeleton.graph.ops
    collectives = tuple(n for n, op in enumerate(ops) if op.kind is OpKind.COLLECTIVE)
    return OpPlaces(dict(zip(map(_NAME, ops), range(len(ops)))), collectives,
                    tuple(n for n in collectives if ops[n].phase is Phase.STEP))


def recent(cache: dict, key, make, limit: int):
    """cache[key], from make() when missing; a full cache drops its least recently used entry
    (a search alternates between structures, and a plan's structure and its probes')."""
    if key in cache:
        cache[key] = cache.pop(key)
    else:
        if len(cache) >= limit:
            del cache[next(iter(cache))]
        cache[key] = make()
    return cache[key]


def by_identity(memo: dict | None, objects: tuple, make: Callable[[], Any]) -> Any:
    """make(), kept in `memo` (None: not kept) for the same `objects`, by identity (arrays,
    tuples of expressions: what is slow or unsafe to hash), kept alive with it."""
    if memo is None:
        return make()
    kept = memo.get(key := tuple(map(id, objects)))
    if kept is None or not all(map(operator.is_, kept[0], objects)):
        kept = memo[key] = (objects, make())
    return kept[1]


@per_graph(limit=4)
def _block_bodies(graph: Graph) -> list[tuple[list[Op], NameTable, int | None, tuple[str, ...]]]:
    """Each block of `graph` (stg/blocks.py) with the part of its sharding signature that its
    ops alone give -- the same for every sharding of the graph: its name table after its
    ops; the ops by place (kind, phase, attributes, names; whether each gradient output has
    contributions still to be summed) and the tensors they make; the names it reads that it
    does not make, in table order (the rest of its signature is their state). The ops and
    tensors are kept as a number, equal for equal blocks (a long tuple is hashed afresh at
    each lookup); None: an attribute is no key."""
    found, numbers = [], {}
    for ops in blocks(graph.ops):
        table, body, made = NameTable(), [], set()
        at = table.at
        for op in ops:
            grad_of = op.attrs.get("grad_of")
            summed = () if not grad_of else tuple(
                any(user.attrs.get("grad_of") == (target,) and user.kind is OpKind.POINTWISE
                    for user in graph.consumers.get(out, ()))
                for out, target in zip(op.outputs, grad_of))
            body.append((op.kind, op.phase, table.attrs(op.attrs), at(op.name), tuple(map(at, op.inputs)),
                         tuple(map(at, op.outputs)), summed))
            made.update(op.outputs)
        shapes = tuple(signature_of(graph.tensors.get(name)) if name in made else None for name in table.names)
        try:
            number = numbers.setdefault((tuple(body), shapes), len(numbers))
        except TypeError:
            number = None
        found.append((ops, table, number, tuple(name for name in table.names if name not in made)))
    return found


@dataclass(frozen=True)
class _Donor:
    """A finished sharding of a graph as a later one resumes it (_Sharder.resume): its graph,
    spec, result, writes, copies' names, templates, and the tables' sizes before each block."""

    graph: Graph
    spec: ShardingSpec
    sharded: ShardedGraph
    changes: list[tuple]
    derived: dict[str, tuple[str, str]]
    templates: dict[tuple, _Template]
    marks: list[tuple[int, ...]]


_DONORS = 3  # the last shardings kept to resume from (a search's ZeRO stages and recomputations)
_DONATED: list[_Donor] = []  # oldest first


def _common_blocks(a: Graph, b: Graph) -> int:
    """How many first blocks (_block_bodies) graphs `a` and `b` have alike: the same leaves,
    then the same op objects making the same tensor objects, block by block, with equal
    signatures (which hold whether a gradient has contributions still to add). A graph
    derived from another keeps its ops where it changes nothing: a recomputation its forward."""
    if len(_leaves(a)) != len(_leaves(b)) or any(x is not y for x, y in zip(_leaves(a), _leaves(b))):
        return 0
    for block, ((ops, _, number, _), (others, _, theirs, _)) in enumerate(zip(_block_bodies(a), _block_bodies(b))):
        if number is None or number != theirs or len(ops) != len(others) or any(
                x is not y or any(a.tensors[name] is not b.tensors[name] for name in x.outputs)
                for x, y in zip(ops, others)):
            return block
    return min(len(_block_bodies(a)), len(_block_bodies(b)))


@per_graph(limit=4)
def _leaves(graph: Graph) -> tuple[Tensor, ...]:
    """The graph's tensors that no op makes (inputs, weights, optimizer states), in order: the
    first entries of every sharder table."""
    return tuple(tensor for tensor in graph.tensors.values() if tensor.name not in graph.producer)


@per_graph(limit=4)
def _leaf_kinds(graph: Graph) -> tuple[tuple[str, ...], list[Tensor], list[int]]:
    """The graph's leaves by kind (alike but for the name): their names, each kind's first
    leaf, and per leaf its kind's place among them."""
    kinds: dict[tuple, int] = {}
    firsts: list[Tensor] = []
    kind_of = []
    for tensor in _leaves(graph):
        kind = kinds.setdefault(tensor.signature, len(kinds))
        if kind == len(firsts):
            firsts.append(tensor)
        kind_of.append(kind)
    return tuple(map(_NAME, _leaves(graph))), firsts, kind_of


@per_graph(limit=4)
def _spec_reads(graph: Graph) -> list[tuple[frozenset, frozenset]]:
    """Per block (_block_bodies), what of a spec its sharding reads: the roles of the leaves
    its ops read (inputs and the names their attributes hold) and the anchor tags whose
    rules their layout rules read."""
    found, producer, tensors = [], graph.producer, graph.tensors
    for ops, _, _, _ in _block_bodies(graph):
        roles, tags = set(), set()
        for op in ops:
            named = op.attrs.get("grad_of", ()) + ((op.attrs["weight"],) if "weight" in op.attrs else ())
            roles.update(tensors[name].role for name in op.inputs + named if name not in producer)
            tags.update(anchors_read(op))
        found.append((frozenset(roles), frozenset(tags)))
    return found


def _agreeing(a: ShardingSpec, b: ShardingSpec, reads: list[tuple[frozenset, frozenset]]) -> int:
    """How many of a graph's first blocks read only what specs `a` and `b` agree on."""
    roles = {role for role in Role if a.role_rules(role) != b.role_rules(role)}
    for block, (read, tags) in enumerate(reads):
        if not roles.isdisjoint(read) or any(a.anchors.get(tag) != b.anchors.get(tag) for tag in tags):
            return block
    return len(reads)


def shard(graph: Graph, spec: ShardingSpec, *, templates: bool = True) -> ShardedGraph:
    """Lay every tensor of `graph` out on the mesh axes in play and insert the collectives.
    `templates=False` shards every block afresh (what the templates must equal)."""
    if not spec.mesh_axes:
        return ShardedGraph(graph, {name: REPLICATED for name in graph.tensors}, dict(graph.tensors), ())
    # No Graph.verify here: the builder checks each op the pass shards as it adds it (a new op
    # name, inputs already made, outputs made once), and a replay makes only new names and reads
    # what its template read, in the state its signature holds (tests/test_sharding.py checks
    # that the replays give the graph sharding every op gives). A walk of tens of thousands of
    # ops less per structure.
    return _Sharder(graph, spec).run(templates)
