"""Parallelism strategies. Each module maps logical axes to mesh axes and does nothing else:
collectives come from stg/redistribute.py, never from a strategy.

`sharding_spec(plan)` merges them into what the sharding pass needs: the layouts of the
weights, optimizer states and inputs, and of the anchors the model and autodiff place (the
residual stream, stored gradients, stored parameters).
"""

from __future__ import annotations

from typing import Callable

from parallelism import context, data, embedding, expert, tensor, zero
from stg.plan import Plan
from stg.sharding import LayoutRules, ShardingSpec

# name -> rules(plan): {target: {logical axis: mesh axes}}; targets: data, params, residual, pooled
STRATEGIES: dict[str, Callable[[Plan], dict[str, dict[str, tuple[str, ...]]]]] = {
    "data": data.rules,
    "context": context.rules,
    "tensor": tensor.rules,
    "expert": expert.rules,
    "embedding": embedding.rules,
}


def sharding_spec(plan: Plan, widened: frozenset[str] = frozenset()) -> ShardingSpec:
    """The plan's spec; `widened`: mesh axes taken in play even where the plan's degree on
    them is 1, so that its structure is the one plans with degrees above 1 share (stg/passes.py,
    unit_bound)."""
    in_play = tuple(axis for axis, size in plan.mesh().axes if size > 1 or axis in widened)
    merged: dict[str, dict[str, tuple[str, ...]]] = {"data": {}, "params": {}, "residual": {}, "pooled": {}}
    for strategy in STRATEGIES.values():
        for target, split in strategy(plan).items():
            for logical, axes in split.items():
                kept = tuple(a for a in axes if a in in_play)
                if kept:
                    merged[target][logical] = merged[target].get(logical, ()) + kept
    for logical, axes in plan.rules or ():  # the plan's own rules win
        for target in ("data", "params"):
            if axes is None:
                merged[target].pop(logical, None)
            elif logical in merged[target] or target == "params":
                merged[target][logical] = tuple(a for a in axes if a in in_play)
    # the residual stream is laid out like the data, plus sequence parallelism's split
    residual = {k: merged["data"].get(k, ()) + merged["residual"].get(k, ())
                for k in {**merged["data"], **merged["residual"]}}
    stored = zero.layouts(plan, merged["params"], in_play)
    anchors = {"residual": LayoutRules(residual), "param": stored["param"]}
    if merged["pooled"]:  # a slot's pooled embeddings: whole features of its own tables
        anchors["pooled"] = LayoutRules(merged["pooled"])
    if stored["grad"] is not None:
        anchors["grad"] = stored["grad"]
    data = LayoutRules(merged["data"])
    # an axis no layout names (pp: it cuts stages, it splits no tensor) leaves the sharded graph
    # as it is, so plans that differ only in it share one structure (stg/passes.py)
    named = set().union(*(rules.axes() for rules in (stored["params"], stored["states"], data, *anchors.values())))
    return ShardingSpec(tuple(a for a in in_play if a in named), stored["params"], stored["states"], data, anchors)
