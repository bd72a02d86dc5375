"""Many plans of one model, evaluated without writing: what `stg summary --json` reports per
rank class (FLOPs by phase, bytes by collective, send/recv bytes, node counts, memory).

Plans that share a structure (the same model and structural choices: sp, recompute, ZeRO
stage, flash attention, which mesh axes split tensors) share the symbolic passes, which
stg/passes.py caches per structure; a plan then costs its lowering per rank class, not its
sympy, and that lowering builds no nodes: an action that repeats one already run adds its
counts again (stg/lower.py). Plans are run grouped by structure and answered in the order
given; with several workers, forked processes each take whole structures. The engine for
plan search (DESIGN.md, stg/explore/).
"""

from __future__ import annotations

from contextlib import closing
from itertools import groupby
from pathlib import Path
from typing import Iterable, Iterator, Mapping

from model_zoo import Model, load_model
from stg.api import build
from stg.errors import PlanError, StgError
from stg.plan import Plan
from stg.workers import forked_map

# Plan fields that are bindings of a structure (stg/passes.py's Structure): plans that differ
# only in these share the symbolic passes; of a degree only whether it is above 1 matters. pp
# splits no tensor (only a tied model's stage cut is structure, which its passes key on).
_DEGREES = ("tp", "cp", "ep", "etp", "local_world_size")
_WIDENED = ("tp", "cp", "ep")
_BINDINGS = ("dp", "pp", "vpp", "schedule", "layers_per_stage", "micro_batch", "global_batch", "seq", "bucket_mb",
             "device", "capacity_factor", "expert_skew", "make_vocab_divisible_by")


def structure_order(plan) -> tuple:
    """A sort key that puts plans sharing a structure next to each other, and within it those
    that bind it alike (which of its degrees are 1) and share a stage cut (pp): (structure,
    degrees above 1, pp)."""
    if not isinstance(plan, Plan):
        return "", (), 0  # checked (and refused) when its turn comes
    fields = plan.to_dict()
    for name in _BINDINGS:
        fields.pop(name, None)
    for name in _DEGREES:
        fields[name] = fields.get(name, 1) > 1
    # plans of tp, cp and ep 1 share the structure of those above 1 (stg/passes.py, unit_bound),
    # which at tp=1 is that of sequence parallelism, tp's default
    for name in _WIDENED:
        fields.pop(name, None)
    fields["sp"] = plan.sp or plan.tp == 1
    if plan.pp > 1:  # ZeRO-2/3 under a pipeline store what ZeRO-1 stores (parallelism/zero.py)
        fields["zero"] = min(plan.zero, 1)
    return repr(sorted(fields.items())), tuple(getattr(plan, name) > 1 for name in _WIDENED), plan.pp


def evaluate(model: Model | str | Path | Mapping, plans: Iterable[Plan | Mapping], *,
             workers: int = 1) -> Iterator[dict]:
    """For each plan, in order: its summary without the per-rank class list, or
    `{"plan": ..., "error": "<why it is invalid>"}` for a plan that does not fit the model.
    `workers`: forked processes, each evaluating whole structures (the rows are the same)."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise PlanError(f"workers: must be a positive integer, got {workers!r}")
    model = model if isinstance(model, Model) else load_model(model)
    plans = [_parsed(plan) for plan in plans]
    keys = list(map(structure_order, plans))
    order = sorted(range(len(plans)), key=keys.__getitem__)
    chunks = [[index] for index in order] if workers == 1 else _chunks(order, keys, workers)
    done: dict[int, dict] = {}
    answered = 0
    with closing(forked_map(lambda chunk: [_row(model, plans[i]) for i in chunk], chunks, workers)) as rows:
        for chunk, found in rows:
            done.update(zip(chunks[chunk], found))
            while answered in done:
                yield done.pop(answered)
                answered += 1


def _chunks(order: list[int], keys: list[tuple], workers: int) -> list[list[int]]:
    """The plans (indices in structure order; `keys`: their structure_order) by structure, so
    that a worker pays each structure's symbolic passes once (about half the time of 1,000
    plans of 12 structures), a structure of more than a worker's share of the plans cut into
    shares; the largest first, so that the workers finish together (longest processing time
    first)."""
    share = -(-len(order) // workers)
    chunks = []
    for _, group in groupby(order, key=lambda i: keys[i][0]):
        group = list(group)
        chunks += [group[start:start + share] for start in range(0, len(group), share)]
    return sorted(chunks, key=len, reverse=True)


def _parsed(plan: Plan | Mapping) -> Plan | dict:
    try:
        return plan if isinstance(plan, Plan) else Plan.from_dict(plan)
    except StgError as error:
        return {"plan": dict(plan), "error": str(error)}


def _row(model: Model, plan: Plan | dict) -> dict:
    if not isinstance(plan, Plan):
        return plan
    try:
        return build(model, plan, nodes=False, short=True).summary(per_rank=False)
    except StgError as error:
        return {"plan": plan.to_dict(), "error": str(error)}
