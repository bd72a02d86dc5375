"""Reverse-mode autodiff over the forward graph, then the optimizer step.

`training_graph(forward)` appends, in reverse order of the forward ops, the backward ops from
per-kind rules, and then one optimizer op per weight. Input-gradient ops (phase B) and
weight-gradient ops (phase W) are separate ops, as a zero-bubble pipeline schedule needs.
A tensor used several times gets its gradient contributions summed by explicit add ops.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from stg.blocks import NameTable, blocks, renamed_attrs, renaming, signature_of
from stg.builder import GraphBuilder, broadcast_dims
from stg.costs import Optimizer, Pointwise
from stg.graph import DType, Graph, Op, OpKind, Phase, Role, Tensor

OPTIMIZER_STATE_DTYPE = DType.FP32  # mixed precision keeps optimizer states in fp32


class _Backward:
    def __init__(self, forward: Graph, grad_dtype: DType | None, optimizer: Optimizer):
        self.forward = forward
        self.grad_dtype = grad_dtype
        self.default_optimizer = optimizer
        self.g = GraphBuilder(forward)
        self.contributions: dict[str, list[str]] = {}
        self.needs_grad = _needs_grad(forward)
        self.stored_grads: dict[str, str] = {}  # weight -> its gradient as accumulated and stored
        self.layer_of: dict[str, int] = {}  # gradient tensor -> the block of the op that made it
        self.optimizer: dict[str, Optimizer] = {}  # weights not stepped by AdamW
        self.updated: set[str] = set()  # weights updated in the backward (fused embedding kernels)
        self.derived: dict[str, tuple[str, str]] = {}  # a name made here -> (the name it extends, suffix)
        self.templates: dict[tuple, _Template] = {}  # a block's signature -> its backward
        # a cast's output -> its input: the gradient keeps the input's dtype (fp8 GEMMs
        # write 16-bit gradients)
        self.cast_from = {op.outputs[0]: op.inputs[0] for op in forward.ops
                          if op.kind is OpKind.POINTWISE and op.attrs["fn"] is Pointwise.CAST}
        # weights read by fp8 GEMMs -> the GEMM's output dtype: a 16-bit weight gets an fp8 copy
        # cast once per step; an fp8 weight (fp8 parameters) gets gradients in that dtype
        self.fp8_weights = {op.inputs[1]: forward.tensors[op.outputs[0]].dtype for op in forward.ops
                            if op.kind is OpKind.EINSUM and op.attrs.get("fp8")}

    # -- bookkeeping ------------------------------------------------------------------------
    def _is_weight(self, name: str) -> bool:
        return self.forward.tensors[name].role is Role.WEIGHT

    def _grad_tensor(self, of: str, name: str) -> Tensor:
        src = self.forward.tensors[of]
        if self._is_weight(of):
            dtype = self.fp8_weights[of] if src.dtype is DType.FP8 else src.dtype
            return Tensor(name, src.shape, src.dims, self.grad_dtype or dtype, Role.GRADIENT)
        dtype = self.forward.tensors[self.cast_from[of]].dtype if of in self.cast_from else src.dtype
        return Tensor(name, src.shape, src.dims, dtype, Role.ACTIVATION, src.transient)

    def _phase(self, of: str) -> Phase:
        return Phase.BACKWARD_WEIGHT if self._is_weight(of) else Phase.BACKWARD_INPUT

    def _name(self, base: str, suffix: str) -> str:
        """base + suffix, remembered so that a replayed block makes its own."""
        self.derived[base + suffix] = (base, suffix)
        return base + suffix

    def _new_contribution(self, of: str) -> str:
        parts = self.contributions.setdefault(of, [])
        name = self._name(of, f".grad/{len(parts)}" if parts else ".grad")
        parts.append(name)
        return name

    def grad_of(self, tensor: str, layer: int) -> str | None:
        """The gradient of `tensor`, summing its contributions with add ops if several."""
        parts = self.contributions.get(tensor)
        if not parts:
            return None
        total = parts[0]
        if len(parts) > 1:
            # sum where the contributions are made: a pipeline stage then sends one gradient
            layer = min(self.layer_of.get(part, layer) for part in parts)
        for k, part in enumerate(parts[1:], start=1):
            name = self._name(tensor, f".grad/sum{k}")
            op = self.g.add_op(name, OpKind.POINTWISE, (total, part), (self._grad_tensor(tensor, name),),
                               {"fn": Pointwise.ADD, "grad_of": (tensor,)}, phase=self._phase(tensor), layer=layer)
            self.layer_of[name] = op.layer
            total = name
        self.contributions[tensor] = [total]
        return total

    def emit(self, op: Op, kind: OpKind, inputs: tuple[str, ...], targets: list[str], attrs: dict | None = None) -> None:
        """One backward op of `op` producing gradient contributions to `targets`."""
        outs = [self._grad_tensor(t, self._new_contribution(t)) for t in targets]
        phase = Phase.BACKWARD_WEIGHT if all(self._is_weight(t) for t in targets) else Phase.BACKWARD_INPUT
        name = outs[0].name if len(outs) == 1 else self._name(op.name, ".backward")
        # `grad_of` names the forward tensors whose gradients the outputs are (for layouts)
        attrs = {**(attrs or {}), "grad_of": tuple(targets)}
        self.g.add_op(name, kind, inputs, outs, attrs, phase=phase, layer=op.layer)
        self.layer_of.update((out.name, op.layer) for out in outs)

    # -- rules ---------------------------------------------------------------------------------
    def einsum(self, op: Op, dout: str) -> None:
        (a_idx, b_idx), out_idx = op.attrs["spec"].split("->")[0].split(","), op.attrs["spec"].split("->")[1]
        a, b = op.inputs
        attrs = {k: v for k, v in op.attrs.items() if k != "spec"}
        if a in self.needs_grad:
            self.emit(op, OpKind.EINSUM, (dout, b), [a], {"spec": f"{out_idx},{b_idx}->{a_idx}", **attrs})
        if b in self.needs_grad:
            self.emit(op, OpKind.EINSUM, (a, dout), [b], {"spec": f"{a_idx},{out_idx}->{b_idx}", **attrs})

    def pointwise(self, op: Op, dout: str) -> None:
        fn = op.attrs["fn"]
        if fn is Pointwise.CAST:  # the gradient passes through (in the input's dtype)
            if op.inputs[0] in self.needs_grad:
                self.contributions.setdefault(op.inputs[0], []).append(dout)
            return
        if fn is Pointwise.ADD:
            # d(a + b) = dout for each; a broadcast operand sums dout over the axes it lacks
            out = self.forward.tensors[op.outputs[0]]
            for x in op.inputs:
                if x not in self.needs_grad:
                    continue
                if broadcast_dims(out, self.forward.tensors[x]):
                    self.emit(op, OpKind.REDUCE, (dout,), [x])
                else:
                    self.contributions.setdefault(x, []).append(dout)
            return
        targets = [x for x in op.inputs if x in self.needs_grad]
        if targets:
            saved = op.inputs if fn.reads_input else ()
            self.emit(op, OpKind.POINTWISE_GRAD, (dout, *saved), targets, {"fn": fn})

    def softmax(self, op: Op, dout: str) -> None:
        self.emit(op, OpKind.SOFTMAX_GRAD, (dout, op.outputs[0]), [op.inputs[0]], _density(op))

    def norm(self, op: Op, dout: str) -> None:
        x, weight, *bias = op.inputs
        if x in self.needs_grad:
            self.emit(op, OpKind.NORM_GRAD, (dout, x, weight), [x], {"norm": op.attrs["norm"]})
        self.emit(op, OpKind.REDUCE, (dout, x), [weight])  # sum over tokens of dout * x_hat
        for b in bias:
            self.emit(op, OpKind.REDUCE, (dout,), [b])

    def embedding(self, op: Op, dout: str) -> None:
        table, ids = op.inputs
        if table in self.needs_grad:
            self.emit(op, OpKind.EMBEDDING_GRAD, (dout, ids), [table])

    def embedding_bag(self, op: Op, dout: str) -> None:
        table, ids, lengths = op.inputs
        fn = op.attrs.get("fn", self.default_optimizer)
        self.optimizer[table] = fn
        if op.attrs.get("update") != "fused":
            self.emit(op, OpKind.EMBEDDING_BAG_GRAD, (dout, ids, lengths), [table], {"fn": fn})
            return
        # no gradient: the touched rows and their states are updated where they are found
        states = self._states(self.forward.tensors[table], fn)
        updated = replace(self.forward.tensors[table], name=self._name(table, ".next"))
        self.g.add_op(self._name(table, f".{fn.label}"), OpKind.EMBEDDING_BAG_UPDATE,
                      (dout, ids, lengths, table, *states), [updated], {"fn": fn, "weight": table, "grad_of": (table,)},
                      phase=Phase.BACKWARD_WEIGHT, layer=op.layer)
        self.updated.add(table)

    def concat(self, op: Op, dout: str) -> None:
        targets = [x for x in op.inputs if x in self.needs_grad]
        if targets:
            self.emit(op, OpKind.CONCAT_GRAD, (dout,), targets, {"dim": op.attrs["dim"]})

    def gather(self, op: Op, dout: str) -> None:
        self.emit(op, OpKind.GATHER_GRAD, (dout,), [op.inputs[0]])

    def dropout(self, op: Op, dout: str) -> None:
        self.emit(op, OpKind.POINTWISE_GRAD, (dout, op.outputs[1]), [op.inputs[0]],
                  {"fn": Pointwise.DROPOUT, **_density(op)})

    def constrain(self, op: Op, dout: str) -> None:
        # the gradient of an anchored tensor is anchored the same way (the residual stream's
        # gradient flows in the residual stream's layout)
        self.emit(op, OpKind.CONSTRAIN, (dout,), [op.inputs[0]], {"tag": op.attrs["tag"]})

    def route(self, op: Op, dout: str) -> None:
        self.emit(op, OpKind.ROUTE_GRAD, (dout, op.outputs[0]), [op.inputs[0]])

    def dispatch(self, op: Op, dout: str) -> None:
        x, gates = op.inputs
        if x in self.needs_grad:
            self.emit(op, OpKind.DISPATCH_GRAD, (dout, gates), [x])

    def combine(self, op: Op, dout: str) -> None:
        buffers, gates = op.inputs
        targets = [t for t in (buffers, gates) if t in self.needs_grad]
        self.emit(op, OpKind.COMBINE_GRAD, (dout, gates, buffers), targets)

    def cross_entropy(self, op: Op) -> None:
        """The seed of the backward: d(mean loss)/d(logits) from logits and the statistics."""
        logits, labels = op.inputs
        self.emit(op, OpKind.CROSS_ENTROPY_GRAD, (logits, op.outputs[0], labels), [logits])

    RULES: dict[OpKind, Callable] = {
        OpKind.EINSUM: einsum,
        OpKind.POINTWISE: pointwise,
        OpKind.SOFTMAX: softmax,
        OpKind.NORM: norm,
        OpKind.EMBEDDING: embedding,
        OpKind.EMBEDDING_BAG: embedding_bag,
        OpKind.CONCAT: concat,
        OpKind.GATHER: gather,
        OpKind.DROPOUT: dropout,
        OpKind.ROUTE: route,
        OpKind.DISPATCH: dispatch,
        OpKind.COMBINE: combine,
        OpKind.CONSTRAIN: constrain,
    }

    def run(self, templates: bool = True) -> Graph:
        first_use: dict[str, Op] = {}
        for op in self.forward.ops:
            for name in op.inputs:
                first_use.setdefault(name, op)
        finished_by: dict[str, list[str]] = {}  # op name -> weights whose gradient it completes
        for weight in self.forward.weights:
            finished_by.setdefault(first_use[weight.name].name, []).append(weight.name)
        for block in blocks(reversed(self.forward.ops)):
            if templates:
                self.differentiate_block(block, finished_by)
            else:
                for op in block:
                    self.differentiate(op, finished_by)
        steps: dict[tuple, tuple] | None = {} if templates else None  # _step's templates
        for weight in self.forward.weights:
            if weight.name not in self.updated:
                self._step(weight, first_use[weight.name].layer, steps)
        return self.g.build()

    def differentiate(self, op: Op, finished_by: dict[str, list[str]]) -> None:
        if op.kind is OpKind.CROSS_ENTROPY:
            self.cross_entropy(op)
        elif (dout := self.grad_of(op.outputs[0], op.layer)) is not None:
            self.RULES[op.kind](self, op, dout)
        for weight in finished_by.get(op.name, ()):
            if weight not in self.updated:
                self._store_grad(weight, op.layer)

    def differentiate_block(self, ops: list[Op], finished_by: dict[str, list[str]]) -> None:
        """The backward of one block's ops (in reverse), or an earlier block's of the same
        signature under this block's names."""
        table, key = self.signature(ops, finished_by)
        template = self.templates.get(key) if key is not None else None
        if template is not None and self.replay(template, table.names, ops[0].layer):
            return
        first = len(self.g.ops)
        for op in ops:
            self.differentiate(op, finished_by)
        if key is None:
            return
        made = self.g.ops[first:]
        layer = ops[0].layer
        self.templates[key] = _Template(
            table.names, layer, made,
            {n: tuple(self.contributions[n]) for n in table.names if n in self.contributions},
            {out: self.layer_of[out] - layer for op in made for out in op.outputs if out in self.layer_of},
            {n: self.stored_grads[n] for n in table.names if n in self.stored_grads},
            frozenset(n for n in table.names if n in self.updated),
            {n: self.optimizer[n] for n in table.names if n in self.optimizer})

    def signature(self, ops: list[Op], finished_by: dict[str, list[str]]) -> tuple[NameTable, tuple | None]:
        """Everything the backward of a block reads, names by their place in its table: the
        ops (and the weights each completes), and per name its tensor, whether it needs a
        gradient, the gradient contributions so far (and the blocks that made them, relative
        to this one), its cast source, fp8 copy and update state."""
        table, layer = NameTable(), ops[0].layer
        at = table.at
        body = tuple((op.kind, table.attrs(op.attrs), at(op.name), tuple(map(at, op.inputs)),
                      tuple(map(at, op.outputs)), tuple(map(at, finished_by.get(op.name, ())))) for op in ops)
        state = []
        for name in table.names:  # grows as contributions and sources are named
            tensor = self.forward.tensors.get(name)
            parts = tuple((at(part), None if part not in self.layer_of else self.layer_of[part] - layer)
                          for part in self.contributions.get(name, ()))
            state.append((signature_of(tensor), name in self.needs_grad, parts,
                          at(self.cast_from[name]) if name in self.cast_from else None, self.fp8_weights.get(name),
                          name in self.updated, at(self.stored_grads[name]) if name in self.stored_grads else None,
                          self.optimizer.get(name)))
        key = (body, tuple(state))
        try:
            hash(key)
        except TypeError:
            return table, None
        return table, key

    def replay(self, template: _Template, names: list[str], layer: int) -> bool:
        """Add `template`'s ops and bookkeeping under this block's names; False (nothing
        changed) when a name it would make exists already."""
        shift, ops = layer - template.layer, template.ops
        rename = self._add_renamed(template.names, names, [n for op in ops for n in (op.name, *op.outputs)], ops,
                                   [self.g.tensors[out] for op in ops for out in op.outputs],
                                   lambda op: op.layer + shift)
        if rename is None:
            return False
        for name, parts in template.contributions.items():
            self.contributions[rename[name]] = [rename[p] for p in parts]
        for name, offset in template.layers.items():
            self.layer_of[rename[name]] = layer + offset
        for weight, grad in template.stored_grads.items():
            self.stored_grads[rename[weight]] = rename[grad]
        self.updated.update(rename[n] for n in template.updated)
        for weight, fn in template.optimizer.items():
            self.optimizer[rename[weight]] = fn
        return True

    def _store_grad(self, weight: str, layer: int) -> None:
        """A weight's gradient is complete once the backward passes its first use: anchor it to
        the layout gradients are stored in (ZeRO-2/3 reduce-scatter it here, per micro-batch)."""
        grad = self.grad_of(weight, layer)
        name = self._name(weight, ".grad.stored")
        self.g.add_op(name, OpKind.CONSTRAIN, (grad,), (replace(self.g.tensors[grad], name=name),),
                      {"tag": "grad"}, phase=Phase.BACKWARD_WEIGHT, layer=layer)
        self.stored_grads[weight] = name

    def _states(self, weight: Tensor, fn: Optimizer) -> list[str]:
        shape, dims = (weight.shape[:1], weight.dims[:1]) if fn.per_row else (weight.shape, weight.dims)
        # an fp32 weight is its own master copy
        names = [s for s in fn.states if not (s == "master" and weight.dtype is OPTIMIZER_STATE_DTYPE)]
        return [self.g.state(self._name(weight.name, f".{s}"), shape, dims, OPTIMIZER_STATE_DTYPE) for s in names]

    def _step(self, weight: Tensor, layer: int, templates: dict[tuple, tuple] | None) -> None:
        """The optimizer step of `weight`, or, with `templates`, that of an earlier weight of its
        kind (a model's layers repeat a few: 1,137 weights of Llama 3 405B, 7 kinds) under its
        names: the same ops, whose costs follow from the same shapes."""
        grad = self.stored_grads[weight.name]
        fn = self.optimizer.get(weight.name, self.default_optimizer)
        fp8 = weight.name in self.fp8_weights and weight.dtype is not DType.FP8
        key = (fn, weight.signature, self.g.tensors[grad].signature, fp8)
        template = None if templates is None else templates.get(key)
        if template is not None and self._replay_step(template, weight.name, grad, layer):
            return
        ops, tensors = self.g.mark()
        self._optimizer(weight, grad, fn, fp8, layer)
        if templates is not None and key not in templates:
            templates[key] = (weight.name, grad, self.g.ops[ops:], list(self.g.tensors.values())[tensors:])

    def _replay_step(self, template: tuple, weight: str, grad: str, layer: int) -> bool:
        """_step's template under `weight`'s names; False (nothing changed) when a name it would
        make exists already."""
        first, first_grad, ops, tensors = template
        made = [*(t.name for t in tensors), *(op.name for op in ops)]
        return self._add_renamed([first, first_grad], [weight, grad], made, ops, tensors, lambda op: layer) is not None

    def _add_renamed(self, names: list[str], renamed_to: list[str], made: list[str], ops: list[Op],
                     tensors: list[Tensor], layer_of) -> dict[str, str] | None:
        """`ops` and `tensors` again, `names` read as `renamed_to` and each name of `made` (in the
        order it was made) from its base and suffix as _name made it, each op in layer
        `layer_of(op)`: added without checks and without sympy, the names' bases recorded. The
        renaming; None (nothing changed) when a name it would make exists already."""
        rename = renaming(names, renamed_to, made, self.derived)
        if any(self.g.named(rename[name]) for name in made if name not in names):
            return None
        for name in made:
            if name in self.derived and name not in names:
                base, suffix = self.derived[name]
                self.derived[rename[name]] = (rename[base], suffix)
        at = rename.__getitem__
        self.g.add_costed([op.renamed(at(op.name), tuple(map(at, op.inputs)), tuple(map(at, op.outputs)), layer_of(op),
                                      renamed_attrs(op.attrs, rename)) for op in ops],
                          [(at(t.name), t.renamed(at(t.name))) for t in tensors])
        return rename

    def _optimizer(self, weight: Tensor, grad: str, fn: Optimizer, fp8: bool, layer: int) -> None:
        states = self._states(weight, fn)
        # the states update in place; the op's one output is the new weight
        updated = Tensor(self._name(weight.name, ".next"), weight.shape, weight.dims, weight.dtype, Role.WEIGHT)
        self.g.add_op(self._name(weight.name, f".{fn.label}"), OpKind.OPTIMIZER, (grad, *states), [updated],
                      {"fn": fn, "weight": weight.name}, phase=Phase.STEP, layer=layer)
        # the new parameters go back to the layout they are stored in (ZeRO-1/2 gather them)
        stored = replace(updated, name=self._name(weight.name, ".next.stored"))
        self.g.add_op(stored.name, OpKind.CONSTRAIN, (updated.name,), [stored], {"tag": "param"},
                      phase=Phase.STEP, layer=layer)
        if fp8:  # TE's fp8 copy, kept until the next step
            copy = Tensor(self._name(weight.name, ".next.fp8"), weight.shape, weight.dims, DType.FP8, Role.WEIGHT)
            self.g.add_op(copy.name, OpKind.POINTWISE, (stored.name,), [copy], {"fn": Pointwise.CAST},
                          phase=Phase.STEP, layer=layer)


@dataclass(frozen=True)
class _Template:
    """The backward of one block: its name table and layer, the ops it added, and the
    bookkeeping of its names after it (gradient contributions, the blocks that made the new
    gradients relative to its own, stored gradients, fused updates, optimizers)."""

    names: list[str]
    layer: int
    ops: list[Op]
    contributions: dict[str, tuple[str, ...]]
    layers: dict[str, int]
    stored_grads: dict[str, str]
    updated: frozenset
    optimizer: dict


def _density(op: Op) -> dict:
    return {"density": op.attrs["density"]} if "density" in op.attrs else {}


def _needs_grad(forward: Graph) -> set[str]:
    needs = {w.name for w in forward.weights}
    for op in forward.ops:
        if any(i in needs for i in op.inputs):
            needs.update(op.outputs)
    return needs


def training_graph(forward: Graph, grad_dtype: DType | None = None, optimizer: Optimizer = Optimizer.ADAMW, *,
                   templates: bool = True) -> Graph:
    """Forward, backward (B and W ops apart) and the optimizer step of one training step
    (`optimizer`; embedding tables that ask for another, such as row-wise Adagrad, get it,
    fused ones in the backward). Weight gradients are `grad_dtype` (default: the weight's
    own dtype). `templates=False` differentiates every block afresh (what replaying an
    equal block's backward must equal)."""
    graph = _Backward(forward, grad_dtype, optimizer).run(templates)
    graph.verify()
    return graph
