"""The search space: every plan of a model on a cluster for a job, each dimension pinned or a list.

Enumeration only builds Plan values; a combination that Plan itself refuses (a batch that does
not divide, ep not dividing dp, ...) is dropped with Plan's own one-line reason. Degrees whose
product does not divide the GPU count never make a plan (dp is what the others leave).

A recommendation model (family dlrm) is searched over its embedding tables' sharding instead:
TorchRec's five types and `auto` (stg's planner), each table-row-wise plan with a host of
`gpus_per_node` ranks (`local_world_size`; dp then counts hosts), the dense part data parallel
over every rank, and the global batch (samples) in micro-batches of `micro_batch` samples per
rank (default: one micro-batch per step). The job's seq does not apply: a sample is one
"token" (tokens/s counts samples).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, fields

from stg.errors import PlanError, StgError
from stg.plan import Plan, Recompute
from stg.schedule import SCHEDULES
from parallelism.embedding import Sharding

EMBEDDING_SHARDINGS = tuple(s.label for s in Sharding)


@dataclass(frozen=True)
class Cluster:
    gpus: int
    device: str = "h100"
    network: str = "dgx-h100-superpod"
    gpus_per_node: int = 8  # the default largest tp

    def __post_init__(self) -> None:
        for name in ("gpus", "gpus_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(f"{name}: must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class Job:
    global_batch: int  # sequences per step
    seq: int

    def __post_init__(self) -> None:
        for name in ("global_batch", "seq"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(f"{name}: must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class Space:
    """Values to try per dimension; None: the default (powers of two that fit, see `resolve`)."""

    tp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    cp: tuple[int, ...] = (1,)
    ep: tuple[int, ...] | None = None  # MoE models only; dense models use 1
    sp: tuple[bool, ...] = (True,)  # with tp > 1 (tp = 1 never splits the sequence)
    zero: tuple[int, ...] = (1,)
    recompute: tuple[str, ...] = ("none", "selective", "full")
    micro_batch: tuple[int, ...] = (1, 2)
    schedule: tuple[str, ...] = ("1f1b", "interleaved")  # with pp > 1
    vpp: tuple[int, ...] = (2,)  # with the interleaved schedule
    max_tp: int | None = None  # default: the cluster's GPUs per node
    embedding_sharding: tuple[str, ...] = ("auto", *EMBEDDING_SHARDINGS)  # recommendation models only

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "max_tp" or value is None:
                continue
            if not isinstance(value, tuple) or not value:
                raise PlanError(f"{f.name}: must be a non-empty list, got {value!r}")
        for name in ("tp", "pp", "cp", "ep", "micro_batch", "vpp"):
            for v in getattr(self, name) or ():
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise PlanError(f"{name}: {v!r} is not a positive integer")
        for v in self.zero:  # refused here, not plan by plan as every plan would be
            if isinstance(v, bool) or v not in (0, 1, 2, 3):
                raise PlanError(f"zero: {v!r} is not a ZeRO stage 0, 1, 2 or 3")
        for v in self.recompute:
            if v not in {r.value for r in Recompute}:
                raise PlanError(f"recompute: {v!r} is not one of {[r.value for r in Recompute]}")
        for v in self.schedule:
            if v not in SCHEDULES:
                raise PlanError(f"schedule: {v!r} is not one of {list(SCHEDULES)}")
        for v in self.embedding_sharding:
            if v not in ("auto", *EMBEDDING_SHARDINGS):
                raise PlanError(f"embedding_sharding: {v!r} is not one of {['auto', *EMBEDDING_SHARDINGS]}")


def _powers(limit: int) -> tuple[int, ...]:
    return tuple(2**k for k in range(limit.bit_length()) if 2**k <= limit)


def resolve(space: Space, cluster: Cluster, layers: int, experts: int | None) -> Space:
    """The space with its defaults filled in: tp up to max_tp, pp up to the layer count, ep up
    to the expert count (1 for dense models), each a power of two no larger than the GPUs."""
    max_tp = space.max_tp or cluster.gpus_per_node
    tp = space.tp or _powers(min(max_tp, cluster.gpus))
    pp = space.pp or _powers(min(layers, cluster.gpus))
    ep = space.ep or (_powers(min(experts, cluster.gpus)) if experts else (1,))
    if not experts and ep != (1,):
        raise PlanError(f"ep: {list(ep)}: the model has no experts")
    return Space(tp=tp, pp=pp, cp=space.cp, ep=ep, sp=space.sp, zero=space.zero, recompute=space.recompute,
                 micro_batch=space.micro_batch, schedule=space.schedule, vpp=space.vpp, max_tp=max_tp,
                 embedding_sharding=space.embedding_sharding)


def recommendation_plans(space: Space, cluster: Cluster, job: Job, dropped: Counter,
                         micro_batch: tuple[int, ...] | None) -> Iterator[Plan]:
    """A recommendation model's plans: each embedding sharding, the dense part data parallel
    (micro_batch None: one micro-batch of global_batch / gpus samples per rank)."""
    for sharding in space.embedding_sharding:
        local = cluster.gpus_per_node if sharding == Sharding.TABLE_ROW_WISE.label else 1
        if cluster.gpus % local:
            dropped["gpus: gpus_per_node does not divide them"] += 1
            continue
        for mb in micro_batch or (max(1, job.global_batch // cluster.gpus),):
            try:
                yield Plan(dp=cluster.gpus // local, local_world_size=local, embedding_sharding=sharding,
                           micro_batch=mb, global_batch=job.global_batch, seq=1, device=cluster.device)
            except StgError as error:
                dropped[reason(error)] += 1


def plans(space: Space, cluster: Cluster, job: Job, dropped: Counter, layers: int) -> Iterator[Plan]:
    """Every plan of a resolved space, in a fixed order; refusals counted in `dropped` by reason.
    Stages split the blocks evenly where pp*vpp divides them, else balanced by compute (`auto`,
    as Llama 3 405B's 126 layers on 16 stages need)."""
    for tp, cp, pp in itertools.product(space.tp, space.cp, space.pp):
        if cluster.gpus % (tp * cp * pp):
            dropped["gpus: tp*cp*pp does not divide them"] += 1
            continue
        dp = cluster.gpus // (tp * cp * pp)
        pipelines = [("1f1b", 1)] if pp == 1 else [
            (s, v) for s in space.schedule for v in (space.vpp if s == "interleaved" else (1,))]
        for ep, sp, (schedule, vpp), zero, recompute, mb in itertools.product(
                space.ep, space.sp if tp > 1 else (False,), pipelines, space.zero, space.recompute,
                space.micro_batch):
            split = None if layers % (pp * vpp) == 0 else "auto"
            try:
                yield Plan(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, sp=sp, vpp=vpp, schedule=schedule, zero=zero,
                           recompute=recompute, micro_batch=mb, global_batch=job.global_batch, seq=job.seq,
                           device=cluster.device, layers_per_stage=split)
            except StgError as error:
                dropped[reason(error)] += 1


def reason(error: StgError) -> str:
    """A refusal's reason for counting: the field its message names first."""
    text = str(error)
    head = text.split(":", 1)[0].split("=", 1)[0].strip()
    field = head if head.replace("_", "").isalnum() and len(head) < 30 else type(error).__name__
    return f"{field} ({type(error).__name__})"
