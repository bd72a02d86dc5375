"""Parallelism strategies. Each module maps logical axes to mesh axes and does nothing else:
collectives come from stg/redistribute.py, never from a strategy."""

from __future__ import annotations

from typing import Callable

from parallelism import data
from stg.plan import Plan

# name -> rules(plan): logical axis -> mesh axes that split it
STRATEGIES: dict[str, Callable[[Plan], dict[str, tuple[str, ...]]]] = {
    "data": data.rules,
}


def logical_rules(plan: Plan) -> dict[str, tuple[str, ...]]:
    """The rules of every strategy, restricted to the mesh axes the plan actually splits."""
    in_play = {axis for axis, size in plan.mesh().axes if size > 1}
    merged: dict[str, tuple[str, ...]] = {}
    for strategy in STRATEGIES.values():
        for logical, axes in strategy(plan).items():
            kept = tuple(a for a in axes if a in in_play)
            if kept:
                merged[logical] = merged.get(logical, ()) + kept
    return merged
