"""Layout rules per op kind: what layouts an op needs of its inputs, given theirs, and what
layouts its outputs have. stg/sharding.py applies them in program order and redistributes
where a tensor's layout differs from what its consumer needs.

Each rule is `(op, input tensors, their layouts, output tensors, sharder) -> (layouts the
inputs must have, layouts of the outputs)`, where the sharder offers the plan's rules
(`sharder.spec`), the mesh axes in play, the layouts so far, and copies already reduced.
Policy on a conflict: weights are stationary, activations move.
"""

from __future__ import annotations

from typing import Callable, Sequence

from stg.costs import Pointwise
from stg.errors import LayoutError
from stg.graph import OpKind, Role, Tensor
from stg.mesh import FLAT, Layout, Partial, Placement, Replicate, Shard


def project(layout: Layout, source: Tensor, target: Tensor) -> Layout:
    """`layout` of `source` seen from `target`, dimensions matched by logical axis name;
    an axis splitting a dimension that target lacks replicates target. Flat shards and
    partial sums carry over."""
    placements = []
    for axis, placement in layout.placements:
        if isinstance(placement, Shard) and placement.dim != FLAT:
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


def unflattened(layout: Layout) -> Layout:
    """Compute cannot use a flat shard: such a tensor is gathered first (ZeRO-3 parameters)."""
    return without(layout, partial=False, dims=[FLAT])


# -- per-kind rules: (op, input tensors, their layouts, output tensors, sharder)
#    -> (layouts the inputs must have, layouts of the outputs) ---------------------------------


def _einsum(op, ins, lays, outs, sharder):
    spec = op.attrs["spec"]
    (ia, ib), iout = spec.split("->")[0].split(","), spec.split("->")[1]
    need = [lays[0].as_dict(), lays[1].as_dict()]
    out = {}
    for axis in sharder.mesh_axes:
        pa, pb = (n.get(axis, Replicate()) for n in need)
        # a partial sum passes through a contraction only if the other side is whole; else it
        # is reduced, scattered along the other side's split when it has that index
        if isinstance(pa, Partial) and pb != Replicate():
            pa = _reduced(need[0], axis, ia, ib, pb)
        if isinstance(pb, Partial) and pa != Replicate():
            pb = _reduced(need[1], axis, ib, ia, pa)
        if isinstance(pa, Partial) or isinstance(pb, Partial):
            out[axis] = Partial()
            continue
        letters = [ia[pa.dim] if isinstance(pa, Shard) else None, ib[pb.dim] if isinstance(pb, Shard) else None]
        if all(letters) and letters[0] != letters[1]:
            # one axis cannot split two indices: one operand is gathered
            letters[_gathered_operand(letters, iout, ins)] = None
        letter = letters[0] or letters[1]
        for idx, n in zip((ia, ib), need):
            n.pop(axis, None)
            if letter is not None and letter in idx:
                n[axis] = Shard(idx.index(letter))  # a replicated side slices locally
        if letter is not None:
            out[axis] = Shard(iout.index(letter)) if letter in iout else Partial()
    order = sharder.mesh_axes
    return [Layout.of(need[0], order), Layout.of(need[1], order)], [Layout.of(out, order)]


def _reduced(need: dict, axis: str, mine: str, other: str, other_placement: Placement) -> Placement:
    letter = other[other_placement.dim] if isinstance(other_placement, Shard) else None
    if letter is not None and letter in mine:
        need[axis] = Shard(mine.index(letter))
    else:
        need.pop(axis)
    return need.get(axis, Replicate())


def _gathered_operand(letters: list[str], out_letters: str, ins: list[Tensor]) -> int:
    """Which operand gives up its split when both are split on one axis along different
    indices: keep the one whose index survives into the output (the result stays split, no
    partial sums); on a tie keep the weight (weights are stationary); else keep the first."""
    survives = [letter in out_letters for letter in letters]
    if survives[0] != survives[1]:
        return 0 if survives[1] else 1
    weights = [t.role is Role.WEIGHT for t in ins]
    if weights[0] != weights[1]:
        return 0 if weights[1] else 1
    return 1


def _elementwise(op, ins, lays, outs, sharder):
    """The output follows the first input; the others are brought to it. Partial sums pass
    only through a linear op (an add, a one-input sum) and only when every input is partial;
    otherwise they are reduced to the layout of the first input that is whole."""
    linear = len(ins) == 1 and op.kind in (OpKind.REDUCE, OpKind.POINTWISE_GRAD) or (
        op.kind is OpKind.POINTWISE and op.attrs["fn"] is Pointwise.ADD
    )  # a one-input gradient op exists only for a linear function (rotary embedding)
    anchor = ins[0]
    if linear and lays[0].partial_axes and (reduced := sharder.reduced_layout(op.inputs[0], op.phase)):
        lays = [reduced, *lays[1:]]  # the partial sum was already reduced for another consumer: reuse it
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
    anchor = 1 if op.kind in (OpKind.SOFTMAX_GRAD, OpKind.NORM_GRAD, OpKind.ROUTE_GRAD) else 0
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
    table_layout = unflattened(sharder.layouts[table_name])
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


def _own_features(sharder, pooled: Tensor) -> dict:
    """Mesh axes on which a rank's pooled embeddings are whole features of its own tables
    (table- and column-wise sharding: the `pooled` rules split the features on them); on any
    other axis that splits the table rows, every rank holds partial sums (row-wise)."""
    rules = sharder.spec.anchors.get("pooled")
    return rules.layout(pooled, sharder.mesh_axes).as_dict() if rules else {}


def _embedding_bag(op, ins, lays, outs, sharder):
    """A table split by rows needs the ids of its rows (routed to it: the input
    distribution) and the lengths of the features it pools -- its own features' (table- and
    column-wise slots) or every feature's (row-wise: any sample may hit its rows); its pooled
    output is then its own features or a partial sum. A table split by columns needs every
    id. A replicated table looks up where the ids are."""
    table, pooled = lays[0], outs[0]
    need_ids, need_lengths, out = lays[1].as_dict(), lays[2].as_dict(), {}
    own = _own_features(sharder, pooled)
    for axis in sharder.mesh_axes:
        placement = table.get(axis)
        if placement == Shard(0):
            need_ids[axis] = Shard(1)
            out[axis] = need_lengths[axis] = own.get(axis, Partial())
        elif placement == Shard(1):
            out[axis] = Shard(2)
            need_ids[axis] = need_lengths[axis] = Replicate()
        elif need_ids.get(axis) == Shard(0):
            out[axis] = need_lengths[axis] = Shard(0)
        else:
            need_ids[axis] = need_lengths[axis] = Replicate()
    need_lengths = {axis: p for axis, p in need_lengths.items() if not isinstance(p, Partial)}
    order = sharder.mesh_axes
    return [table, Layout.of(need_ids, order), Layout.of(need_lengths, order)], [Layout.of(out, order)]


def _embedding_bag_backward(op, ins, lays, outs, sharder):
    """The table gradient (or the fused update) is made where the table is, from the ids and
    lengths as the lookup had them and the pooled gradient of every sample whose ids hit the
    rank's rows (gathered for a row-wise split) or of the rank's own features."""
    (table_name,) = op.attrs["grad_of"]
    table = unflattened(sharder.layouts[table_name])
    need_grad, need_ids, need_lengths, out = lays[0].as_dict(), lays[1].as_dict(), lays[2].as_dict(), {}
    own = _own_features(sharder, ins[0])
    for axis in sharder.mesh_axes:
        placement = table.get(axis)
        if isinstance(placement, Shard):
            need_ids[axis] = Shard(1) if placement.dim == 0 else Replicate()
            need_grad[axis] = need_lengths[axis] = own.get(axis, Replicate()) if placement.dim == 0 else Shard(2)
            out[axis] = placement
        elif need_grad.get(axis) == Shard(0):
            if op.kind is OpKind.EMBEDDING_BAG_UPDATE:
                raise LayoutError(f"op {op.name}: a fused update needs table {table_name} split on mesh axis "
                                  f"{axis}, which splits the batch (a replicated table needs its gradient reduced)")
            need_ids[axis] = need_lengths[axis] = Shard(0)
            out[axis] = Partial()
        else:
            need_grad[axis] = need_ids[axis] = need_lengths[axis] = Replicate()
    need_lengths = {axis: p for axis, p in need_lengths.items() if p != Shard(2)}
    order = sharder.mesh_axes
    needed = [Layout.of(need_grad, order), Layout.of(need_ids, order), Layout.of(need_lengths, order), *lays[3:]]
    return needed, [Layout.of(out, order)]


def _concat(op, ins, lays, outs, sharder):
    """The output keeps the first input's splits of the axes it shares with it, and is
    whole along the concatenated dimension; every input is brought to that (a table-wise
    input, split by features, comes to the batch split: an all-to-all)."""
    target = without(project(lays[0], ins[0], outs[0]), dims=[op.attrs["dim"]])
    return [project(target, outs[0], t) for t in ins], [target]


def _concat_grad(op, ins, lays, outs, sharder):
    target = without(lays[0], dims=[op.attrs["dim"]])
    return [target], [project(target, ins[0], o) for o in outs]


def _gather(op, ins, lays, outs, sharder):
    """A selection keeps the splits of the dimensions it keeps; the others must be whole.
    Its gradient scatters back where the selection is (partial sums pass: it is linear)."""
    target = lays[0]
    if op.kind is OpKind.GATHER:
        target = without(target, dims=[i for i, logical in enumerate(ins[0].dims) if logical not in outs[0].dims])
    return [target], [project(target, ins[0], outs[0])]


def _cross_entropy(op, ins, lays, outs, sharder):
    """Vocabulary-parallel cross-entropy (Megatron): logits may stay split on the vocabulary;
    the per-token statistics then come out as partial sums over that split."""
    logits, labels = ins[0], ins[-1]
    layout = without(lays[0])
    vocab_dim = len(logits.shape) - 1
    needed_labels = project(without(layout, dims=[vocab_dim]), logits, labels)
    if op.kind is OpKind.CROSS_ENTROPY_GRAD:
        # reads the reduced statistics; the gradient keeps the logits' split
        stats = project(without(layout, dims=[vocab_dim]), logits, ins[1])
        return [layout, stats, needed_labels], [layout]
    stats = project(layout, logits, outs[0])
    split = {ax: Partial() for ax in layout.axes_sharding(vocab_dim)}
    return [layout, needed_labels], [Layout.of({**stats.as_dict(), **split}, sharder.mesh_axes)]


def _loss(op, ins, lays, outs, sharder):
    """The mean over tokens: whole statistics in, a partial sum over the token splits out."""
    layout = without(lays[0], dims=[len(ins[0].shape) - 1])
    return [layout], [Layout.of({ax: Partial() for ax, _ in layout.placements}, sharder.mesh_axes)]


def _optimizer(op, ins, lays, outs, sharder):
    """The step runs on the states' layout (ZeRO shards them); the gradient is brought to it."""
    states = lays[1]
    return [project(states, ins[1], t) for t in ins], [states]


def _constrain(op, ins, lays, outs, sharder):
    rules = sharder.spec.anchors.get(op.attrs["tag"])
    layout = lays[0] if rules is None else rules.layout(ins[0], sharder.mesh_axes)
    return [layout], [layout]


def _tokens(layout: Layout, tensor: Tensor) -> dict:
    """The mesh axes that split a tensor's token dimensions (all but the last)."""
    return {ax: p for ax, p in layout.placements if isinstance(p, Shard) and p.dim < len(tensor.shape) - 1}


def _by_origin(tokens: dict, width: Layout, order) -> Layout:
    """Expert buffers [expert, capacity, embed] whose capacity slots are split the way their
    tokens were (each rank's slots hold its own tokens), embed split like `width`."""
    return Layout.of({**{ax: Shard(1) for ax in tokens}, **width.as_dict()}, order)


def _dispatch(op, ins, lays, outs, sharder):
    """Routing moves tokens into expert buffers where they stand; the buffers go to the
    experts' ranks when an op needs them split by expert: Shard(capacity) -> Shard(expert),
    an ALL_TO_ALL, and back the same way (Megatron-Core's all-to-all token dispatcher)."""
    order = sharder.mesh_axes
    if op.kind is OpKind.DISPATCH:
        x, gates = ins
        layout = without(lays[0], dims=[len(x.shape) - 1])
        hidden = {ax: Shard(2) for ax, p in without(lays[0]).placements if p == Shard(len(x.shape) - 1)}
        return [without(lays[0]), project(layout, x, gates)], [_by_origin(_tokens(layout, x), Layout.of(hidden, order), order)]
    # combine, dispatch_grad, combine_grad: the tokens' layout comes from the gates
    gates_index = 1
    tokens = _tokens(without(lays[gates_index]), ins[gates_index])
    gates = Layout.of(tokens, order)
    buffers = _by_origin(tokens, Layout(), order)
    token_out = lambda t: project(gates, ins[gates_index], t)
    if op.kind is OpKind.COMBINE:
        return [buffers, gates], [token_out(outs[0])]
    if op.kind is OpKind.DISPATCH_GRAD:
        return [buffers, gates], [token_out(outs[0])]
    # combine_grad: (d_out, gates, buffers) -> (d_buffers, d_gates)
    needed = [token_out(ins[0]), gates, buffers]
    produced = [buffers if o.dims[:1] == ins[2].dims[:1] else token_out(o) for o in outs]
    return needed, produced


def _passthrough(op, ins, lays, outs, sharder):
    raise AssertionError(f"op {op.name}: {op.kind} is created by sharding, not sharded")


def anchors_read(op) -> tuple[str, ...]:
    """The anchor tags whose rules (`sharder.spec.anchors`) the op's rule reads: an anchor its
    own tag's, an embedding bag's lookup and backward the pooled features'. stg/sharding.py
    resumes one plan's sharding from another's up to the first op whose reads differ: a rule
    that reads more of the spec must say so here."""
    if op.kind is OpKind.CONSTRAIN:
        return (op.attrs["tag"],)
    if op.kind in (OpKind.EMBEDDING_BAG, OpKind.EMBEDDING_BAG_GRAD, OpKind.EMBEDDING_BAG_UPDATE):
        return ("pooled",)
    return ()


RULES: dict[OpKind, Callable] = {
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
    OpKind.EMBEDDING_BAG: _embedding_bag,
    OpKind.EMBEDDING_BAG_GRAD: _embedding_bag_backward,
    OpKind.EMBEDDING_BAG_UPDATE: _embedding_bag_backward,
    OpKind.CONCAT: _concat,
    OpKind.CONCAT_GRAD: _concat_grad,
    OpKind.GATHER: _gather,
    OpKind.GATHER_GRAD: _gather,
    OpKind.CROSS_ENTROPY: _cross_entropy,
    OpKind.CROSS_ENTROPY_GRAD: _cross_entropy,
    OpKind.LOSS: _loss,
    OpKind.DROPOUT: _elementwise,
    OpKind.CONSTRAIN: _constrain,
    OpKind.ROUTE: _along_last_dim,
    OpKind.ROUTE_GRAD: _along_last_dim,
    OpKind.DISPATCH: _dispatch,
    OpKind.DISPATCH_GRAD: _dispatch,
    OpKind.COMBINE: _dispatch,
    OpKind.COMBINE_GRAD: _dispatch,
    OpKind.OPTIMIZER: _optimizer,
    OpKind.ATTENTION: _elementwise,  # per head: the cache follows the queries' head split
    OpKind.COLLECTIVE: _passthrough,
    OpKind.SLICE: _passthrough,
}
