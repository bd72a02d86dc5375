"""The Python API: the same three nouns as the CLI.

    from stg import load_model, Plan, generate
    summary = generate("llama3-8b", Plan(dp=8, global_batch=64, seq=4096), out="out/")

`build` runs every pass short of writing files and returns a Workload to inspect:
its sharded graph, its rank-class programs, its summary.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Mapping

import sympy

from model_zoo import Model, load_model
from parallelism import sharding_spec
from stg.autodiff import training_graph
from stg.device import device_spec
from stg.emit import Progress, count_trace_set, write_trace_set
from stg.errors import PlanError
from stg.groups import GroupIds
from stg.graph import DType, Phase
from parallelism.pipeline import cut, stage_plan
from stg.chakra.writer import fixed_varint, rank_width
from stg.lower import Evaluator, Pipeline, check_divisibility, lower
from stg.program import GroupHole, RankProgram
from stg.schedule import SPLIT_BACKWARD, make_schedule
from stg.memory import Memory, memory
from stg.mesh import DeviceMesh, axis_symbol
from stg.plan import Plan
from stg.recompute import recompute
from stg.sharding import ShardedGraph, shard
from model_zoo.moe import CF
from stg.symbols import ATTN_FRACTION, B, S

from stg import __version__


@dataclass(frozen=True)
class Workload:
    model: Model
    plan: Plan
    mesh: DeviceMesh
    sharded: ShardedGraph
    programs: tuple[RankProgram, ...]
    memory: tuple[Memory, ...]  # per rank class
    bindings: Mapping[sympy.Symbol, Any]

    def class_of(self, rank: int) -> int:
        """Ranks of one pipeline stage run the same program up to their groups and peers."""
        return (rank // self.mesh.stride("pp")) % self.plan.pp

    def hole_values(self, rank: int, holes) -> dict:
        """The bytes that stamp `rank` from its class skeleton: group ids, rank numbers."""
        width = rank_width(self.mesh.size)
        values = {}
        for hole in holes:
            if isinstance(hole, GroupHole):
                values[hole] = str(self.group_ids.id(rank, hole.axes)).encode()
            else:
                peer = rank if hole.stage is None else rank + (hole.stage - self.class_of(rank)) * self.mesh.stride("pp")
                values[hole] = fixed_varint(peer, width)
        return values

    @cached_property
    def group_ids(self) -> GroupIds:
        return GroupIds.for_kinds(self.mesh, (h.axes for p in self.programs for h in p.holes if isinstance(h, GroupHole)))

    def summary(self) -> dict:
        world = self.mesh.size
        stride = self.mesh.stride("pp")  # pp is the slowest axis: class c is one block of ranks
        classes = [
            {"class": index, "ranks": [[index * stride, (index + 1) * stride - 1]], "count": stride,
             **program.stats.to_dict(), "memory": self.memory[index].to_dict()}
            for index, program in enumerate(self.programs)
        ]
        per_rank = [index for index in range(len(self.programs)) for _ in range(stride)]
        return {
            "stg_version": __version__,
            "model": {**self.model.describe(), "source": self.model.source},
            "plan": self.plan.to_dict(),
            "mesh": dict(self.mesh.axes),
            "world_size": world,
            "microbatches": self.plan.microbatches,
            "tokens_per_step": self.plan.global_batch * self.plan.seq,
            "groups": {"+".join(k): self.mesh.size // _group_size(self.mesh, k) for k in self.group_ids.kinds},
            "totals": {
                "flops": sum(c["flops"] * c["count"] for c in classes),
                "flops_forward_backward": sum(c["flops_forward_backward"] * c["count"] for c in classes),
            },
            # per-rank figures: rank_classes[rank_class[r]] (ranks of one class are identical)
            "rank_classes": classes,
            "rank_class": per_rank,
        }


def _group_size(mesh: DeviceMesh, kind: tuple[str, ...]) -> int:
    size = 1
    for axis in kind:
        size *= mesh.sizes[axis]
    return size


def _check_fits(model: Model, plan: Plan) -> None:
    limit = getattr(model.config, "max_positions", None)
    if getattr(model.config, "positions", None) == "learned" and plan.seq > limit:
        raise PlanError(f"seq={plan.seq} exceeds model {model.name}'s max_positions={limit} (learned positions)")


def build(model: Model | str | Path | Mapping, plan: Plan | Mapping) -> Workload:
    """Every pass from the model description to the rank-class programs."""
    model = model if isinstance(model, Model) else load_model(model)
    plan = plan if isinstance(plan, Plan) else Plan.from_dict(plan)
    _check_fits(model, plan)
    mesh = plan.mesh()
    train = training_graph(model.forward_graph(plan.flash_attention), DType.parse(plan.grad_dtype))
    sharded = shard(recompute(train, plan.recompute, last_block=model.layers), sharding_spec(plan))
    bindings = {
        **model.config.sizes(vocab_multiple=plan.make_vocab_divisible_by * plan.tp),
        B: plan.micro_batch * plan.data_ranks,
        S: plan.seq,
        ATTN_FRACTION: plan.attention_flops.fraction,
        CF: sympy.Rational(str(plan.capacity_factor)),
        **{axis_symbol(axis): size for axis, size in mesh.axes},
    }
    check_divisibility(sharded, bindings)
    evaluate = Evaluator(bindings)
    pipeline = _pipeline(model, plan, sharded)
    programs, memories = [], []
    for rank in range(plan.pp):  # one rank class per pipeline stage
        programs.append(lower(sharded, evaluate, device_spec(plan.device), pipeline=pipeline,
                              bucket_bytes=int(plan.bucket_mb * 2**20), rank=rank))
        memories.append(memory(sharded, evaluate, pipeline.stages, pipeline.schedule[rank], rank))
    return Workload(model, plan, mesh, sharded, tuple(programs), tuple(memories), bindings)


TAG_LIMIT = 400_000_000  # below ASTRA-sim's 500,000,000 limit on comm_tag


def _pipeline(model: Model, plan: Plan, sharded: ShardedGraph) -> Pipeline:
    if plan.pp == 1:
        return Pipeline.single_stage(plan.microbatches)
    stages = stage_plan(plan, model.layers)
    for weight in sharded.graph.weights:  # e.g. an output layer tied to the embedding
        used_on = {stages.virtual_stage(op.layer) for op in sharded.graph.consumers.get(weight.name, ())
                   if op.phase is not Phase.STEP}
        if len(used_on) > 1:
            raise PlanError(f"pp={plan.pp}: weight {weight.name} of model {model.name} is used on pipeline stages "
                            f"{sorted(used_on)}; a weight shared across stages (tied embeddings) is not supported yet")
    schedule = make_schedule(plan.schedule, plan.pp, plan.microbatches, plan.vpp)
    edges = tuple(cut(sharded.graph, stages))
    if plan.microbatches * len(edges) >= TAG_LIMIT:
        raise PlanError(f"microbatches={plan.microbatches}: too many for unique send/recv tags below {TAG_LIMIT:,}")
    return Pipeline(stages, schedule, plan.schedule in SPLIT_BACKWARD, edges)


def generate(
    model: Model | str | Path | Mapping,
    plan: Plan | Mapping,
    out: str | Path,
    progress: Progress | None = None,
    *,
    ranks: range | None = None,
    workers: int = 1,
) -> dict:
    """Write OUT/workload.<rank>.et (for `ranks`, default all), OUT/workload.json and
    OUT/summary.json, stamping with `workers` processes; return the summary."""
    workload = build(model, plan)
    summary = workload.summary()
    write_trace_set(Path(out), workload, summary, progress, ranks=_check_ranks(ranks, workload), workers=workers)
    return summary


def count(model: Model | str | Path | Mapping, plan: Plan | Mapping) -> dict:
    """Everything but the writing: the bytes and nodes a full set would have, with the summary."""
    workload = build(model, plan)
    return {**count_trace_set(workload), "summary": workload.summary()}


def _check_ranks(ranks: range | None, workload: Workload) -> range | None:
    world = workload.mesh.size
    if ranks is not None and not (0 <= ranks.start < ranks.stop <= world and ranks.step == 1):
        raise PlanError(f"ranks: {ranks.start}:{ranks.stop} is not a non-empty range within 0:{world}")
    return ranks
