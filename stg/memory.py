"""Per-rank memory of a training step, read off the sharded graph.

  weights           the parameters as stored (ZeRO-3: a flat shard)
  gradients         the weight gradients as accumulated and stored: whole while they
                    accumulate unsynchronised (ZeRO-0/1), a shard once reduce-scattered (ZeRO-2/3)
  optimizer_states  fp32 master weights and Adam moments (ZeRO-1+: a flat shard)
  activations       what the backward reads of the forward: every tensor a forward op makes
                    that a backward op consumes, in its local layout, times the micro-batches
                    in flight (one without pipelining). Transient tensors (fused attention's
                    scores) are not kept. A gathered copy is not kept either: the backward
                    gathers again (stg/sharding.py), so the saved tensor is the local shard.
  peak              their sum: the model states plus one step's saved activations (working
                    buffers of single kernels and collectives are not counted)

All in bytes, per rank, from local shapes: right by construction for every strategy.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from stg.graph import OpKind, Phase, Role
from stg.lower import Evaluator
from stg.sharding import ShardedGraph

_BACKWARD = (Phase.BACKWARD_INPUT, Phase.BACKWARD_WEIGHT)


@dataclass(frozen=True)
class Memory:
    weights: int
    gradients: int
    optimizer_states: int
    activations: int
    activations_by_layer: dict[int, int] = field(default_factory=dict)  # one micro-batch

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
        }


def stored_gradient(sharded: ShardedGraph, grad: str) -> str:
    """The tensor a gradient is kept in between micro-batches: the optimizer's input traced
    back through the step's collectives and views to where the backward left it."""
    producer = sharded.graph.producer
    while grad in producer and producer[grad].phase is Phase.STEP:
        grad = producer[grad].inputs[0]
    return grad


def memory(sharded: ShardedGraph, evaluate: Evaluator, in_flight: int = 1) -> Memory:
    graph = sharded.graph
    leaves = [t for name, t in graph.tensors.items() if name not in graph.producer]
    weights = sum(evaluate(t.nbytes) for t in leaves if t.role is Role.WEIGHT)
    states = sum(evaluate(t.nbytes) for t in leaves if t.role is Role.OPTIMIZER_STATE)
    grads = {stored_gradient(sharded, op.inputs[0]) for op in graph.ops if op.kind is OpKind.OPTIMIZER}
    gradients = sum(evaluate(graph.tensors[g].nbytes) for g in grads)
    by_layer: Counter = Counter()
    for name, users in graph.consumers.items():
        made_by = graph.producer.get(name)
        if made_by is None or made_by.phase is not Phase.FORWARD:
            continue
        if any(user.phase in _BACKWARD for user in users):
            by_layer[made_by.layer] += evaluate(graph.tensors[name].memory_bytes)
    return Memory(weights, gradients, states, in_flight * sum(by_layer.values()), dict(sorted(by_layer.items())))
