"""Many plans of one model, evaluated without writing: what `stg summary --json` reports per
rank class (FLOPs by phase, bytes by collective, send/recv bytes, node counts, memory).

Plans that share a structure (the same model and structural choices: sp, recompute, ZeRO
stage, flash attention, which mesh axes are in play) share the symbolic passes, which
stg/api.py caches per structure; a plan then costs its lowering per rank class, not its
sympy. The engine for plan search (DESIGN.md, stg/explore/).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator, Mapping

from model_zoo import Model, load_model
from stg.api import build
from stg.errors import StgError
from stg.plan import Plan


def evaluate(model: Model | str | Path | Mapping, plans: Iterable[Plan | Mapping]) -> Iterator[dict]:
    """For each plan, in order: its summary without the per-rank class list, or
    `{"plan": ..., "error": "<why it is invalid>"}` for a plan that does not fit the model."""
    model = model if isinstance(model, Model) else load_model(model)
    for plan in plans:
        try:
            plan = plan if isinstance(plan, Plan) else Plan.from_dict(plan)
            yield build(model, plan).summary(per_rank=False)
        except StgError as error:
            yield {"plan": plan.to_dict() if isinstance(plan, Plan) else dict(plan), "error": str(error)}
