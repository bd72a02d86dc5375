"""Data parallelism: every rank holds the whole model and a slice of the batch.

The batch dimension is split over dp (and local: the ranks of a host, a second data-parallel
axis that recommendation models use for table-row-wise sharding); weights are replicated. Everything else falls out of
the shared machinery: a weight gradient contracts the batch, so it comes out Partial(dp),
and the optimizer needs it whole, so redistribution inserts an ALL_REDUCE over dp, once per
step, coalesced into buckets by the lowering.
"""

from __future__ import annotations

from stg.plan import Plan


def rules(plan: Plan) -> dict[str, dict[str, tuple[str, ...]]]:
    return {"data": {"batch": ("dp", "local")}}
