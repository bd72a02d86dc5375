"""Per-rank memory of a training step, read off the sharded graph.

  weights           the parameters as stored (ZeRO-3: a flat shard), and with fp8 their fp8
                    copies (cast after each step's update)
  gradients         the weight gradients as accumulated and stored: whole while they
                    accumulate unsynchronised (ZeRO-0/1), a shard once reduce-scattered (ZeRO-2/3)
  optimizer_states  fp32 master weights and Adam moments (ZeRO-1+: a flat shard)
  activations       what the backward reads of the forward: every tensor a forward op makes
                    that a backward op consumes, in its local layout, held from its forward
                    until the last backward pass that reads it, at the peak of the pipeline
                    schedule (1F1B: p - r micro-batches on stage r; GPipe: all m; one without
                    pipelining). Transient tensors (fused attention's
                    scores) are not kept. A gathered copy is not kept either: the backward
                    gathers again (stg/sharding.py), so the saved tensor is the local shard.
  peak              their sum: the model states plus one step's saved activations (working
                    buffers of single kernels and collectives are not counted)
  embedding_*       the part of weights and optimizer_states that is embedding tables (the
                    tables and row-wise optimizer states a rank holds, recommendation models)

All in bytes, per rank, from local shapes: right by construction for every strategy.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from functools import cached_property
from operator import attrgetter

import sympy

from stg.costs import Pointwise
from stg.graph import OpKind, Phase, Role
from stg.lower import Evaluator
from parallelism.pipeline import block_weight
from stg.sharding import CUT_LIMIT, ShardedGraph, by_identity, per_graph

_BACKWARD = (Phase.BACKWARD_INPUT, Phase.BACKWARD_WEIGHT)
_LAYER = attrgetter("layer")


@dataclass(frozen=True)
class Memory:
    weights: int
    gradients: int
    optimizer_states: int
    activations: int
    activations_by_layer: dict[int, int] = field(default_factory=dict)  # one micro-batch
    embedding_weights: int = 0
    embedding_optimizer_states: int = 0

    @property
    def peak(self) -> int:
        return self.weights + self.gradients + self.optimizer_states + self.activations

    def to_dict(self) -> dict:
        return {
            "weights": self.weights,
            "gradients": self.gradients,
            "optimizer_states": self.optimizer_states,
            "activations": self.activations,
            "peak": self.peak,
            **({"embedding_weights": self.embedding_weights,
                "embedding_optimizer_states": self.embedding_optimizer_states} if self.embedding_weights else {}),
        }


def stored_gradient(sharded: ShardedGraph, grad: str) -> str:
    """The tensor a gradient is kept in between micro-batches: the optimizer's input traced
    back through the step's collectives and views to where the backward left it."""
    producer = sharded.graph.producer
    while grad in producer and producer[grad].phase is Phase.STEP:
        grad = producer[grad].inputs[0]
    return grad


@dataclass(frozen=True)
class _Index:
    """What memory() reads of a sharded graph, gathered in one pass and kept per graph:
    per-rank calls then sum over their stage's layers instead of scanning the graph."""

    # leaves by (role, layers of their users, embedding table?, table state?): their bytes,
    # each distinct expression with how many leaves have it (a model's blocks repeat them)
    leaves: tuple[tuple[Role, frozenset, bool, bool, tuple[tuple[sympy.Expr, int], ...]], ...]
    casts: tuple[tuple[int, sympy.Expr], ...]  # fp8 copies made in the step: layer, bytes
    grads: tuple[tuple[int, str, sympy.Expr], ...]  # per optimizer op: layer, stored gradient, bytes
    # forward-made, backward-read, per layer: bytes, how many such tensors, how many a W pass reads
    saved: dict[int, tuple[tuple[sympy.Expr, int, int], ...]]

    @cached_property
    def layers(self) -> frozenset[int]:
        return frozenset(layer for _, used, _, _, _ in self.leaves for layer in used) | set(self.saved) | {
            item[0] for items in (self.casts, self.grads) for item in items}

    @cached_property
    def by_layer(self) -> dict[int, tuple[tuple, tuple, tuple]]:
        """Per layer, the leaf groups its ops read (indices into `leaves`), its casts' bytes and
        its (stored gradient, bytes): a stage gathers its own layers'."""
        found: dict[int, tuple[list, list, list]] = {layer: ([], [], []) for layer in self.layers}
        for n, (_, used, _, _, _) in enumerate(self.leaves):
            for layer in used:
                found[layer][0].append(n)
        for layer, nbytes in self.casts:
            found[layer][1].append(nbytes)
        for layer, grad, nbytes in self.grads:
            found[layer][2].append((grad, nbytes))
        return {layer: tuple(map(tuple, lists)) for layer, lists in found.items()}


@per_graph
def _index(sharded: ShardedGraph) -> _Index:
    graph = sharded.graph
    users, producer, tensors, ops = graph.consumers, graph.producer, graph.tensors, graph.ops
    # (tens of thousands of ops: each question a comprehension over them)
    saved: dict[int, dict] = {}  # what the backward reads of what the forward makes, by the maker's layer
    forward, backward_phases, weight_pass = Phase.FORWARD, _BACKWARD, Phase.BACKWARD_WEIGHT
    for op in [op for op in ops if op.phase is forward]:
        for name in op.outputs:
            backward = [user for user in users.get(name, ()) if user.phase in backward_phases]
            if backward:
                counts = saved.setdefault(op.layer, {}).setdefault(tensors[name].memory_bytes, [0, 0])
                counts[0] += 1
                counts[1] += any(user.phase is weight_pass for user in backward)
    stored = [(op.layer, stored_gradient(sharded, op.inputs[0])) for op in ops if op.kind is OpKind.OPTIMIZER]
    grads = tuple((layer, g, tensors[g].nbytes) for layer, g in stored)
    step, pointwise, cast = Phase.STEP, OpKind.POINTWISE, Pointwise.CAST
    casts = tuple((op.layer, tensors[op.outputs[0]].nbytes) for op in ops
                  if op.kind is pointwise and op.phase is step and op.attrs["fn"] is cast)
    tables = {op.inputs[0] for op in ops if op.kind is OpKind.EMBEDDING_BAG}
    table_states = frozenset(name for op in ops if op.attrs.get("weight") in tables for name in op.inputs
                             if tensors[name].role is Role.OPTIMIZER_STATE) if tables else frozenset()
    # leaves by (role, layers of their users, embedding table?, table state?), then bytes
    counted = Counter((t.role, frozenset(map(_LAYER, users.get(name, ()))), name in tables, name in table_states,
                       t.nbytes) for name, t in tensors.items() if name not in producer)
    leaves: dict[tuple, list] = {}
    for (*group, nbytes), n in counted.items():
        leaves.setdefault(tuple(group), []).append((nbytes, n))
    return _Index(tuple((*group, tuple(sizes)) for group, sizes in leaves.items()), casts, grads,
                  {layer: tuple((nbytes, n, w) for nbytes, (n, w) in kept.items()) for layer, kept in saved.items()})


def shared_leaves(sharded: ShardedGraph) -> list[frozenset[int]]:
    """The layers of each group of leaves that ops of more than one layer read."""
    return [used for _, used, _, _, _ in _index(sharded).leaves if len(used) > 1]


@per_graph(limit=CUT_LIMIT)
def _stage_shares(sharded: ShardedGraph, stages) -> dict:
    """_stage_share's answers per pipeline stage, kept per structure and cut; under "layers"
    each stage's layers, under "parts" each distinct part of an answer (alike stages share
    one object, which memory() sizes once per plan)."""
    return {}


def _stage_layers(sharded: ShardedGraph, stages, shares: dict) -> dict[int, frozenset]:
    """Each pipeline stage's layers under `stages`, found for all at once (a cut of 64 stages
    asks for each), each set made in layer order as one stage's would be."""
    if "layers" not in shares:
        by_rank: dict[int, list[int]] = {}
        for layer in _index(sharded).layers:
            by_rank.setdefault(stages.rank_and_chunk(stages.virtual_stage(layer))[0], []).append(layer)
        shares["layers"] = {rank: frozenset(layers) for rank, layers in by_rank.items()}
    return shares["layers"]


def _stage_share(sharded: ShardedGraph, stages, rank: int) -> tuple:
    """What memory() sums for pipeline stage `rank` under `stages` (None: the whole graph),
    each distinct expression once with how many times it counts: the bytes of the leaves its
    ops read (by role, and whether an embedding table or a table's state), of its casts and
    of its stored gradients (a gradient counted once); and per layer, its saved tensors."""
    shares = _stage_shares(sharded, stages)
    if rank not in shares:
        index = _index(sharded)
        mine = index.layers if stages is None else _stage_layers(sharded, stages, shares).get(rank, frozenset())
        # a short model's block may stand for several (stg/short.py): its own leaves, casts and
        # gradients count once per block it stands for
        weight = block_weight(stages)
        leaves: Counter = Counter()
        for n in sorted({n for layer in mine for n in index.by_layer[layer][0]}):
            role, used, table, table_state, sizes = index.leaves[n]
            copies = weight(next(iter(used))) if len(used) == 1 else 1
            for nbytes, count in sizes:
                leaves[(role, table, table_state, nbytes)] += count * copies
        casts: Counter = Counter()
        stored: dict[str, tuple] = {}
        for layer in mine:
            for nbytes in index.by_layer[layer][1]:
                casts[nbytes] += weight(layer)
            for g, nbytes in index.by_layer[layer][2]:
                stored.setdefault(g, (nbytes, weight(layer)))  # a gradient counted once
        grads: Counter = Counter()
        for nbytes, copies in stored.values():
            grads[nbytes] += copies
        saved = _Saved.of(index, sorted(layer for layer in mine if layer in index.saved), stages)
        parts = shares.setdefault("parts", {})
        one = lambda part: parts.setdefault(part, part)  # noqa: E731
        shares[rank] = (one(tuple(leaves.items())), one(tuple(casts.items())), one(tuple(grads.items())),
                        replace(saved, patterns=one(saved.patterns)))
    return shares[rank]


@dataclass(frozen=True)
class _Saved:
    """A stage's saved tensors by pattern (what one layer keeps: the copies of a block keep
    alike ones, sized once per plan): the distinct patterns, each layer's pattern in layer
    order, and per pattern how many of its layers each chunk holds."""

    patterns: tuple[tuple[tuple[sympy.Expr, int, int], ...], ...]
    layers: tuple[tuple[int, int], ...]  # (layer, its pattern's place)
    chunks: tuple[tuple[tuple[int, int], ...], ...]  # per pattern: (chunk, layers)

    @classmethod
    def of(cls, index: _Index, layers: list[int], stages) -> "_Saved":
        """Of `layers` (in order, each with saved tensors), on their chunks under `stages`."""
        places: dict[tuple, int] = {}
        weight = block_weight(stages)  # (a short model's block may stand for several: stg/short.py)
        chunks: list[Counter] = []
        found = []
        for layer in layers:
            place = places.setdefault(index.saved[layer], len(places))
            if place == len(chunks):
                chunks.append(Counter())
            chunks[place][0 if stages is None else stages.rank_and_chunk(stages.virtual_stage(layer))[1]] += \
                weight(layer)
            found.append((layer, place))
        return cls(tuple(places), tuple(found), tuple(tuple(sorted(counts.items())) for counts in chunks))


def memory(sharded: ShardedGraph, evaluate: Evaluator, stages=None, in_flight=None, rank: int = 0) -> Memory:
    """Memory of pipeline stage `rank` (its virtual stages under `stages`) running its
    schedule, of which `in_flight` (stg.schedule.StageDigest) tells the micro-batches held;
    without it, the whole graph and one micro-batch at a time."""
    leaves, casts, grads, saved = _stage_share(sharded, stages, rank)
    weights, gradients, states, embedding, sized = by_identity(
        evaluate.held, (leaves, casts, grads, saved.patterns),
        lambda: _sized(evaluate, leaves, casts, grads, saved.patterns))
    by_layer = {layer: sized[place][0] for layer, place in saved.layers}
    if in_flight is None:
        activations = sum(by_layer.values())
    else:
        activations = _peak(in_flight, saved, sized)
    return Memory(weights, gradients, states, activations, by_layer, *embedding)


def _sized(evaluate: Evaluator, leaves: tuple, casts: tuple, grads: tuple, patterns: tuple) -> tuple:
    """A stage share's parts in bytes under `evaluate`'s bindings: its weights, gradients and
    optimizer states, the embedding tables' and their states' bytes, and per saved-tensor
    pattern (its bytes, the bytes a W pass reads)."""
    held: Counter = Counter()  # bytes of the leaves this stage's ops read, by role
    embedding = [0, 0]  # of them, the embedding tables' and their optimizer states'
    for (role, table, table_state, nbytes), n in leaves:
        size = n * evaluate(nbytes)
        held[role] += size
        embedding[0] += size if table else 0
        embedding[1] += size if table_state else 0
    # fp8 training: the weights' fp8 copies, cast once per step and kept until the next
    weights = held[Role.WEIGHT] + sum(n * evaluate(nbytes) for nbytes, n in casts)
    states = held[Role.OPTIMIZER_STATE]
    gradients = sum(n * evaluate(nbytes) for nbytes, n in grads)
    # saved tensors per block: freed after the backward's B pass, or kept until its W pass;
    # the copies of a block keep alike tensors, whose sizes are found once
    sized = []  # per pattern: (its bytes, the bytes a W pass reads)
    for kept in patterns:
        sizes = [(n, read_by_w, evaluate(nbytes)) for nbytes, n, read_by_w in kept]
        sized.append((sum(n * size for n, _, size in sizes), sum(w * size for _, w, size in sizes)))
    return weights, gradients, states, embedding, sized


def _peak(in_flight, saved: _Saved, sized: list[tuple[int, int]]) -> int:
    """Most bytes held while running the schedule: a forward adds its chunk's saved tensors,
    its B pass frees those only B reads, its W pass the rest; at each point of `in_flight`
    (stg.schedule.StageDigest) a chunk holds all its saved bytes for each micro-batch between
    F and B, and those W reads for each between B and W."""
    totals: Counter = Counter()
    lates: Counter = Counter()
    for (total, late), chunks in zip(sized, saved.chunks):
        for chunk, layers in chunks:
            totals[chunk] += layers * total
            lates[chunk] += layers * late
    weights = [size for c in range(len(in_flight[0]) // 2) for size in (totals[c], lates[c])]
    return max(sum(w * n for w, n in zip(weights, point) if n) for point in in_flight)
