"""From one layout to another: which collectives, on which mesh axes, of how many bytes.

The rule table is DESIGN.md's, keyed by the (from, to) placement kinds on one mesh axis.
`plan_redistribution` only plans (a list of CommSteps with local shapes before and after);
stg/sharding.py turns the steps into collective ops of the sharded graph.

comm_size follows ASTRA-sim's (and NCCL's) convention: the bytes each rank puts in, i.e. the
local input of the step. ALL_REDUCE: the full buffer; REDUCE_SCATTER and ALL_TO_ALL: the full
per-rank input; ALL_GATHER: the per-rank shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import sympy

from stg.errors import LayoutError
from stg.graph import FastEnum
from stg.mesh import Layout, Partial, Replicate, Shard


class Collective(FastEnum):
    """Values are Chakra's CollectiveCommType numbers."""

    ALL_REDUCE = 0
    ALL_GATHER = 2
    ALL_TO_ALL = 6
    REDUCE_SCATTER = 7


# (from, to) placement kinds on one axis -> the collective; None: a local slice, no traffic.
RULES: dict[tuple[type, type], Collective | None] = {
    (Partial, Replicate): Collective.ALL_REDUCE,
    (Partial, Shard): Collective.REDUCE_SCATTER,
    (Shard, Replicate): Collective.ALL_GATHER,
    (Shard, Shard): Collective.ALL_TO_ALL,
    (Replicate, Shard): None,
}
# reduce while the data is small, gather last: the order in which steps run
_ORDER = [Collective.REDUCE_SCATTER, Collective.ALL_REDUCE, Collective.ALL_TO_ALL, None, Collective.ALL_GATHER]


@dataclass(frozen=True)
class CommStep:
    collective: Collective | None  # None: slice locally
    axes: tuple[str, ...]
    before: tuple[sympy.Expr, ...]  # local shape going in
    after: tuple[sympy.Expr, ...]  # local shape coming out
    layout: Layout  # the tensor's layout after this step


def plan_redistribution(
    tensor: str, shape: Sequence[sympy.Expr], src: Layout, dst: Layout, mesh_order: Sequence[str]
) -> list[CommStep]:
    """Steps that turn `src` into `dst`; axes that need the same collective go together, as
    one collective over their combined group (each axis reaching its own placement: a
    table-row-wise input distribution is one all-to-all over all ranks, as in TorchRec)."""
    by_rule: dict[Collective | None, list[str]] = {}
    for axis in mesh_order:
        a, b = src.get(axis), dst.get(axis)
        if a == b:
            continue
        key = (type(a), type(b))
        if key not in RULES:
            raise LayoutError(f"tensor {tensor}: cannot turn {a} into {b} on mesh axis {axis}")
        by_rule.setdefault(RULES[key], []).append(axis)

    steps, current = [], src
    for collective, axes in sorted(by_rule.items(), key=lambda kv: _ORDER.index(kv[0])):
        placements = current.as_dict()
        for axis in axes:
            placements[axis] = dst.get(axis)
        after = Layout.of(placements, mesh_order)
        steps.append(
            CommStep(collective, tuple(axes), current.local_shape(shape), after.local_shape(shape), after)
        )
        current = after
    assert current == dst, (tensor, current, dst)
    return steps
