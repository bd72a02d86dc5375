"""Layout propagation: from a training graph and logical-axis rules to the sharded graph.

Leaves (inputs, weights, optimizer states) get their layouts from the rules (logical axis ->
mesh axes). Then each op, in program order, states the layouts it needs of its inputs and the
layouts of its outputs (`_RULES`, one function per op kind). Where a tensor's layout differs
from what its consumer needs, stg/redistribute.py plans the collectives and they enter the
graph as COLLECTIVE ops. Policy on a conflict: weights are stationary, activations move.

The result holds *local* shapes (`B/dp`), so every op's FLOPs and bytes, and every collective's
size, are recomputed from what one rank holds: right by construction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from stg.builder import GraphBuilder
from stg.costs import Pointwise
from stg.graph import Graph, Op, OpKind, Phase, Role, Tensor
from stg.mesh import REPLICATED, Layout, Partial, Placement, Replicate, Shard
from stg.redistribute import plan_redistribution

Rules = Mapping[str, Sequence[str]]  # logical axis -> mesh axes that split it


@dataclass(frozen=True)
class ShardedGraph:
    graph: Graph  # local shapes, collectives inserted
    layouts: Mapping[str, Layout]  # every tensor's layout on the mesh
    global_tensors: Mapping[str, Tensor]  # every tensor's global shape
    mesh_axes: tuple[str, ...]  # the mesh axes in play (size > 1), in mesh order

    def describe(self, tensor: str) -> str:
        return self.layouts[tensor].describe(self.global_tensors[tensor].shape)


def leaf_layout(tensor: Tensor, rules: Rules, mesh_axes: Sequence[str]) -> Layout:
    """Shard every dimension whose logical axis the rules map; one mesh axis splits one dim."""
    placements: dict[str, Placement] = {}
    for dim, logical in enumerate(tensor.dims):
        for axis in rules.get(logical, ()):
            if axis in mesh_axes and axis not in placements:
                placements[axis] = Shard(dim)
    return Layout.of(placements, mesh_axes)


def project(layout: Layout, source: Tensor, target: Tensor) -> Layout:
    """`layout` of `source` seen from `target`, dimensions matched by logical axis name;
    an axis splitting a dimension that target lacks replicates target."""
    placements = []
    for axis, placement in layout.placements:
        if isinstance(placement, Shard):
            logical = source.dims[placement.dim]
            if logical in target.dims:
                placements.append((axis, Shard(target.dims.index(logical))))
        else:
            placements.append((axis, placement))
    return Layout(tuple(placements))


def without(layout: Layout, *, partial: bool = True, dims: Sequence[int] = ()) -> Layout:
    """`layout` with its Partial axes reduced and the given dimensions gathered."""
    return Layout(
        tuple(
            (ax, p)
            for ax, p in layout.placements
            if not (partial and isinstance(p, Partial)) and not (isinstance(p, Shard) and p.dim in dims)
        )
    )


class _Sharder:
    def __init__(self, graph: Graph, rules: Rules, mesh_axes: Sequence[str], optimizer_rules: Rules | None):
        self.src = graph
        self.mesh_axes = tuple(mesh_axes)
        self.rules = rules
        self.optimizer_rules = optimizer_rules if optimizer_rules is not None else rules
        self.layouts: dict[str, Layout] = {}
        self.global_tensors: dict[str, Tensor] = {}
        self.g = GraphBuilder()
        self.memo: dict[tuple[str, Layout, str], str] = {}

    def tensor(self, name: str) -> Tensor:
        return self.global_tensors[name]

    def define(self, tensor: Tensor, layout: Layout) -> None:
        self.global_tensors[tensor.name] = tensor
        self.layouts[tensor.name] = layout
        local = Tensor(tensor.name, layout.local_shape(tensor.shape), tensor.dims, tensor.dtype, tensor.role, tensor.transient)
        self.g.tensors[tensor.name] = local

    def run(self) -> ShardedGraph:
        for tensor in self.src.tensors.values():
            if tensor.name not in self.src.producer:
                rules = self.optimizer_rules if tensor.role is Role.OPTIMIZER_STATE else self.rules
                self.define(tensor, leaf_layout(tensor, rules, self.mesh_axes))
        for op in self.src.ops:
            ins = [self.tensor(i) for i in op.inputs]
            outs = [self.src.tensors[o] for o in op.outputs]
            needed, produced = _RULES[op.kind](op, ins, [self.layouts[i] for i in op.inputs], outs, self)
            inputs = tuple(self.redistribute(name, layout, op) for name, layout in zip(op.inputs, needed))
            for tensor, layout in zip(outs, produced):
                self.define(tensor, layout)
            local_outs = [self.g.tensors.pop(o.name) for o in outs]  # add_op registers them again
            self.g.add_op(op.name, op.kind, inputs, local_outs, dict(op.attrs), phase=op.phase, layer=op.layer)
        return ShardedGraph(self.g.build(), self.layouts, self.global_tensors, self.mesh_axes)

    def redistribute(self, name: str, layout: Layout, consumer: Op) -> str:
        current = self.layouts[name]
        if current == layout:
            return name
        phase_group = {Phase.FORWARD: "F", Phase.STEP: "S"}.get(consumer.phase, "B")
        key = (name, layout, phase_group)
        if key in self.memo:
            return self.memo[key]
        tensor = self.tensor(name)
        result = name
        for step in plan_redistribution(name, tensor.shape, current, layout, self.mesh_axes):
            kind = "slice" if step.collective is None else step.collective.name.lower()
            out_name = f"{name}.{kind}[{','.join(step.axes)}]" + ("" if phase_group == "F" else f".{phase_group}")
            out = Tensor(out_name, tensor.shape, tensor.dims, tensor.dtype, tensor.role, tensor.transient)
            self.global_tensors[out_name] = out
            self.layouts[out_name] = step.layout
            local = Tensor(out_name, step.after, tensor.dims, tensor.dtype, tensor.role, tensor.transient)
            attrs = {"detail": kind, "axes": step.axes}
            if step.collective is not None:
                attrs["collective"] = step.collective
            op_kind = OpKind.COLLECTIVE if step.collective is not None else OpKind.SLICE
            self.g.add_op(out_name, op_kind, (result,), [local], attrs, phase=consumer.phase, layer=consumer.layer)
            result = out_name
        self.memo[key] = result
        return result


# -- per-kind rules: (op, input tensors, their layouts, output tensors, sharder)
#    -> (layouts the inputs must have, layouts of the outputs) ---------------------------------


def _einsum(op, ins, lays, outs, sharder):
    spec = op.attrs["spec"]
    (ia, ib), iout = spec.split("->")[0].split(","), spec.split("->")[1]
    ta, tb = ins
    need_a, need_b, out = lays[0].as_dict(), lays[1].as_dict(), {}
    weight_b = tb.role is Role.WEIGHT
    for axis in sharder.mesh_axes:
        pa, pb = need_a.get(axis, Replicate()), need_b.get(axis, Replicate())
        # a partial sum may pass through a contraction only if the other side is whole
        if isinstance(pa, Partial) and isinstance(pb, Partial):
            need_b.pop(axis)
            pb = Replicate()
        if isinstance(pa, Partial) and pb != Replicate():
            need_a.pop(axis)
            pa = Replicate()
        if isinstance(pb, Partial) and pa != Replicate():
            need_b.pop(axis)
            pb = Replicate()
        if isinstance(pa, Partial) or isinstance(pb, Partial):
            out[axis] = Partial()
            continue
        la = ia[pa.dim] if isinstance(pa, Shard) else None
        lb = ib[pb.dim] if isinstance(pb, Shard) else None
        if la and lb and la != lb:
            # conflict on one axis: keep the weight (or the first operand) and gather the other
            if weight_b:
                need_a.pop(axis)
                la = None
            else:
                need_b.pop(axis)
                lb = None
        letter = la or lb
        if letter is None:
            continue
        for idx, need in ((ia, need_a), (ib, need_b)):
            if letter in idx:
                need[axis] = Shard(idx.index(letter))  # a replicated side slices locally
        out[axis] = Shard(iout.index(letter)) if letter in iout else Partial()
    order = sharder.mesh_axes
    return [Layout.of(need_a, order), Layout.of(need_b, order)], [Layout.of(out, order)]


def _elementwise(op, ins, lays, outs, sharder):
    """The output follows the first input; the others are brought to it. Partial sums pass
    only through a linear op (an add, a one-input sum) and only when every input is partial;
    otherwise they are reduced to the layout of the first input that is whole."""
    linear = (op.kind is OpKind.POINTWISE and op.attrs["fn"] is Pointwise.ADD) or (
        op.kind is OpKind.REDUCE and len(ins) == 1
    )
    anchor = ins[0]
    target = {}
    for axis in sharder.mesh_axes:
        seen = [project(Layout(((axis, l.get(axis)),)), t, anchor).get(axis) for l, t in zip(lays, ins)]
        whole = [p for p in seen if not isinstance(p, Partial)]
        target[axis] = whole[0] if whole else (Partial() if linear else Replicate())
    layout = Layout.of(target, sharder.mesh_axes)
    needed = [project(layout, anchor, t) for t in ins]
    produced = [project(layout, anchor, o) for o in outs]
    if op.kind is OpKind.REDUCE:
        # summed-away dimensions that were split become partial sums
        summed = {ax: Partial() for ax, p in layout.placements if isinstance(p, Shard) and anchor.dims[p.dim] not in outs[0].dims}
        produced = [Layout.of({**produced[0].as_dict(), **summed}, sharder.mesh_axes)]
    return needed, produced


def _along_last_dim(op, ins, lays, outs, sharder):
    """Softmax and norms reduce over the last dimension: it must be whole, and no partial sums.
    Gradient ops take their layout from the forward tensor they read (their second input)."""
    anchor = 1 if op.kind in (OpKind.SOFTMAX_GRAD, OpKind.NORM_GRAD) else 0
    target = without(lays[anchor], dims=[len(ins[anchor].shape) - 1])
    return [project(target, ins[anchor], t) for t in ins], [project(target, ins[anchor], o) for o in outs]


def _embedding(op, ins, lays, outs, sharder):
    table, ids = ins
    need_ids = lays[1].as_dict()
    out = {}
    for axis in sharder.mesh_axes:
        pt = lays[0].get(axis)
        if isinstance(pt, Shard):
            need_ids.pop(axis, None)  # the table stays put; ids are gathered if they clash
            out[axis] = Partial() if pt.dim == 0 else Shard(len(ids.shape) + pt.dim - 1)
        elif isinstance(need_ids.get(axis), Shard):
            out[axis] = need_ids[axis]
    order = sharder.mesh_axes
    return [lays[0], Layout.of(need_ids, order)], [Layout.of(out, order)]


def _embedding_grad(op, ins, lays, outs, sharder):
    grad, ids = ins
    (table_name,) = op.attrs["grad_of"]
    table_layout = sharder.layouts[table_name]
    need_grad, need_ids, out = lays[0].as_dict(), lays[1].as_dict(), {}
    for axis in sharder.mesh_axes:
        pt = table_layout.get(axis)
        if isinstance(pt, Shard):
            # each rank scatters into its own part of the table: it needs the whole gradient
            need_grad.pop(axis, None)
            need_ids.pop(axis, None)
            if pt.dim > 0:
                need_grad[axis] = Shard(len(ids.shape) + pt.dim - 1)
            out[axis] = pt
        elif need_grad.get(axis) is not None:
            out[axis] = Partial()  # tokens split over this axis: every rank holds a partial sum
    order = sharder.mesh_axes
    return [Layout.of(need_grad, order), Layout.of(need_ids, order)], [Layout.of(out, order)]


def _cross_entropy(op, ins, lays, outs, sharder):
    logits, labels = ins
    target = without(lays[0], dims=[len(logits.shape) - 1])
    needed = [target, project(target, logits, labels)]
    if op.kind is OpKind.CROSS_ENTROPY_GRAD:
        return needed, [target]
    # the mean loss over tokens split across ranks is a partial sum
    return needed, [Layout.of({ax: Partial() for ax, _ in target.placements}, sharder.mesh_axes)]


def _optimizer(op, ins, lays, outs, sharder):
    state_layout = lays[1]  # states are laid out by the optimizer rules (ZeRO shards them)
    return [project(state_layout, ins[1], t) for t in ins], [state_layout]


def _passthrough(op, ins, lays, outs, sharder):
    raise AssertionError(f"op {op.name}: {op.kind} is created by sharding, not sharded")


_RULES: dict[OpKind, Callable] = {
    OpKind.EINSUM: _einsum,
    OpKind.POINTWISE: _elementwise,
    OpKind.POINTWISE_GRAD: _elementwise,
    OpKind.REDUCE: _elementwise,
    OpKind.SOFTMAX: _along_last_dim,
    OpKind.SOFTMAX_GRAD: _along_last_dim,
    OpKind.NORM: _along_last_dim,
    OpKind.NORM_GRAD: _along_last_dim,
    OpKind.EMBEDDING: _embedding,
    OpKind.EMBEDDING_GRAD: _embedding_grad,
    OpKind.CROSS_ENTROPY: _cross_entropy,
    OpKind.CROSS_ENTROPY_GRAD: _cross_entropy,
    OpKind.OPTIMIZER: _optimizer,
    OpKind.COLLECTIVE: _passthrough,
    OpKind.SLICE: _passthrough,
}


def shard(graph: Graph, rules: Rules, mesh_axes: Sequence[str], optimizer_rules: Rules | None = None) -> ShardedGraph:
    """Lay every tensor of `graph` out on the mesh axes in play and insert the collectives."""
    if not mesh_axes:
        layouts = {name: REPLICATED for name in graph.tensors}
        return ShardedGraph(graph, layouts, dict(graph.tensors), ())
    sharded = _Sharder(graph, rules, mesh_axes, optimizer_rules).run()
    sharded.graph.verify()
    return sharded
