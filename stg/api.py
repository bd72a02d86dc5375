"""The Python API: the same three nouns as the CLI.

    from stg import load_model, Plan, generate
    summary = generate("llama3-8b", Plan(dp=8, global_batch=64, seq=4096), out="out/")

`build` runs every pass short of writing files and returns a Workload to inspect:
its sharded graph, its rank-class programs, its summary.
"""

from __future__ import annotations

import gc
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from functools import cached_property, partial
from itertools import chain
from operator import attrgetter
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import sympy

from model_zoo import GraphOptions, Model, load_model
from model_zoo.dlrm import DLRMConfig
from model_zoo.transformer import TransformerConfig
from parallelism.embedding import EmbeddingPlan, plan_embeddings
from stg import numeric
from stg.device import device_spec
from stg.emit import Progress, count_trace_set, lower_counted, write_trace_set
from stg.errors import PlanError
from stg.groups import GroupIds
from stg.graph import OpKind, Phase
from stg.limits import MAX_EMBEDDING_RANKS, MAX_NODES
from parallelism.pipeline import StagePlan, block_weight, cut, stage_plan
from stg.chakra.writer import fixed_varint, rank_width
from stg.lower import VIEWS, Evaluator, Pipeline, check_divisibility, crossings, lower
from stg.program import GroupHole, RankHole, RankProgram
from stg.schedule import SPLIT_BACKWARD, Order, order
from stg.memory import Memory, memory, shared_leaves
from stg.mesh import DeviceMesh, axis_symbol
from stg.passes import held_leaves, passes_cached, structure_of, symbolic_passes, uncut_passes, unit_bound
from stg.plan import Plan
from stg.sharding import CUT_LIMIT, ShardedGraph, per_graph
from stg.short import ShortForm, short_form
from model_zoo.moe import CF, LOAD, E
from stg.symbols import ATTN_FRACTION, B, S

from stg import __version__

# the data, context, tensor and expert axes: a transformer's plan without nodes shares the
# structure of plans of degree above 1 on them (unit_bound); the pipeline degree keeps its own
_WIDENED = frozenset({"dp", "cp", "tp", "ep"})


@dataclass(frozen=True)
class Workload:
    model: Model
    plan: Plan
    mesh: DeviceMesh
    sharded: ShardedGraph
    programs: tuple[RankProgram, ...]  # per pipeline stage, per variant
    memory: tuple[Memory, ...]  # per rank class
    bindings: Mapping[sympy.Symbol, Any]
    # Ranks of one pipeline stage run one program up to their groups and peers, unless their
    # coordinates on variant_axes give them different work (an expert slot's load under
    # routing skew, the embedding tables a rank holds): variant_map[i] is the variant of
    # coordinate i on those axes (mixed radix, slowest first).
    variant_axes: tuple[str, ...] = ()
    variant_map: tuple[int, ...] = ()
    embeddings: EmbeddingPlan | None = None
    stages: Any = None  # StagePlan when pipelined

    @property
    def variants(self) -> int:
        return len(self.programs) // self.plan.pp

    def _variant_index(self, rank: int) -> int:
        index = 0
        for axis in self.variant_axes:
            index = index * self.mesh.sizes[axis] + (rank // self.mesh.stride(axis)) % self.mesh.sizes[axis]
        return index

    def class_of(self, rank):
        """The rank class of `rank` (an int, or a numpy array of ranks: one class each)."""
        stage = (rank // self.mesh.stride("pp")) % self.plan.pp
        if not self.variant_axes:
            return stage * self.variants
        variant = np.asarray(self.variant_map)[self._variant_index(rank)]
        return stage * self.variants + (variant if isinstance(rank, np.ndarray) else int(variant))

    @cached_property
    def _members(self) -> tuple[tuple[int, int], ...]:
        """Per class: (its lowest rank, how many ranks it has), by arithmetic on the mesh."""
        per_stage = self.mesh.size // self.plan.pp
        width = len(self.variant_map) if self.variant_axes else 1
        first, count = {}, Counter()
        for index in range(width):
            variant = self.variant_map[index] if self.variant_axes else 0
            count[variant] += per_stage // width
            if variant not in first:
                coords, rest = {}, index
                for axis in reversed(self.variant_axes):
                    rest, coords[axis] = divmod(rest, self.mesh.sizes[axis])
                first[variant] = self.mesh.rank(coords)
        return tuple((first[v] + stage * self.mesh.stride("pp"), count[v])
                     for stage in range(self.plan.pp) for v in range(self.variants))

    def representative(self, cls: int) -> int:
        """The lowest rank of class `cls`."""
        return self._members[cls][0]

    def class_count(self, cls: int) -> int:
        return self._members[cls][1]

    def hole_values(self, rank: int, holes) -> dict:
        """The bytes that stamp `rank` from its class skeleton: group ids, rank numbers."""
        width = rank_width(self.mesh.size)
        values = {}
        for hole in holes:
            if isinstance(hole, GroupHole):
                values[hole] = str(self.group_ids.id(rank, hole)).encode()
            else:
                values[hole] = fixed_varint(self.peer(rank, hole), width)
        return values

    def peer(self, rank: int, hole: RankHole) -> int:
        """The rank a RankHole of `rank`'s program stands for: itself, or its pipeline peer."""
        if hole.stage is None:
            return rank
        stride = self.mesh.stride("pp")
        return rank + (hole.stage - (rank // stride) % self.plan.pp) * stride

    @cached_property
    def group_ids(self) -> GroupIds:
        holes: set = set()
        for program in self.programs:  # a program lowered without nodes has its holes as a set (unsorted)
            holes.update(program.holes if program.counted_holes is None else program.counted_holes)
        return GroupIds.for_kinds(self.mesh, (hole for hole in holes if isinstance(hole, GroupHole)))

    def summary(self, per_rank: bool = True) -> dict:
        """What summary.json holds; `per_rank=False` leaves out `rank_class` (one entry per
        rank: the only part that grows with the world)."""
        world = self.mesh.size
        classes = []
        for index, program in enumerate(self.programs):
            stage, variant = divmod(index, self.variants)
            where = {"class": index, "coords": {"pp": stage}, "count": self.class_count(index)}
            if self.variants > 1:
                where["variant"] = variant
                where["first_rank"] = self.representative(index)
            else:  # pp is the slowest axis: a stage is one block of ranks
                where["ranks"] = [[index * where["count"], (index + 1) * where["count"] - 1]]
            classes.append({**where, **program.stats.to_dict(), "memory": self.memory[index].to_dict()})
        summary = {
            "stg_version": __version__,
            "model": {**self.model.describe(), "source": self.model.source},
            "plan": self.plan.to_dict(),
            "mesh": dict(self.mesh.axes),
            "world_size": world,
            "microbatches": self.plan.microbatches,
            # Megatron-Core's expert-data-parallel size: ranks holding the same experts
            **({"expert_data_parallel": self.plan.expert_data_parallel} if self.plan.ep > 1 else {}),
            # blocks per virtual stage (the first also runs the embedding, the last the head)
            **({"layers_per_stage": list(self.stages.split(self.model.layers))} if self.stages else {}),
            "tokens_per_step": self.plan.global_batch * self.plan.seq,
            "groups": {str(k): self.group_ids.groups_of(k) for k in self.group_ids.kinds},
            "totals": {
                "flops": sum(c["flops"] * c["count"] for c in classes),
                "flops_forward_backward": sum(c["flops_forward_backward"] * c["count"] for c in classes),
            },
            # per-rank figures: rank_classes[rank_class[r]] (ranks of one class are identical)
            "rank_classes": classes,
        }
        if per_rank:
            summary["rank_class"] = self.class_of(np.arange(world, dtype=np.int64)).tolist()
        if self.embeddings is not None:
            summary["samples_per_step"] = summary.pop("tokens_per_step") // self.plan.seq
            summary["embedding_plan"] = self.embeddings.table()
            summary["embedding_slots"] = self.embeddings.padding()
        return summary


def _check_fits(model: Model, plan: Plan) -> None:
    limit = getattr(model.config, "max_positions", None)
    if getattr(model.config, "positions", None) == "learned" and plan.seq > limit:
        raise PlanError(f"seq={plan.seq} exceeds model {model.name}'s max_positions={limit} (learned positions)")


def _block_costs(model: Model, plan: Plan) -> list[int] | None:
    """Forward FLOPs of one micro-batch per block 0..L+1, for `layers_per_stage: auto` (the
    backward's GEMMs are twice their forward, so forward FLOPs rank the blocks alike)."""
    if plan.layers_per_stage != "auto":
        return None
    graph = model.forward_graph(GraphOptions(plan.flash_attention))
    values = {**model.config.sizes(vocab_multiple=plan.make_vocab_divisible_by * plan.tp), B: plan.micro_batch,
              S: plan.seq, ATTN_FRACTION: plan.attention_flops.fraction, CF: sympy.Rational(str(plan.capacity_factor)),
              LOAD: 1}
    numbers = {symbol: n for symbol, v in values.items() if (n := numeric.exact(sympy.sympify(v))) is not None}
    kinds, kind_of = _block_flops(graph, model.layers)
    costs = [numeric.ceiling(sum(count * numeric.bound(expr, numbers, values) for expr, count in terms))
             for terms in kinds]
    return [costs[kind] for kind in kind_of]


@per_graph
def _block_flops(graph, layers: int) -> tuple[list[tuple], list[int]]:
    """The distinct blocks of a forward graph by their ops' FLOP expressions (with how many
    ops have each; the copies of a block share theirs), and which one each block 0..L+1 is."""
    per_block: dict[int, Counter] = {}
    for op in graph.ops:
        per_block.setdefault(op.layer, Counter())[op.flops] += 1
    kinds: dict[tuple, int] = {}
    kind_of = [kinds.setdefault(tuple(per_block.get(layer, {}).items()), len(kinds)) for layer in range(layers + 2)]
    return list(kinds), kind_of


def _in_dtype(model: Model, plan: Plan) -> Model:
    """The model in the plan's dtype (part of its config, so graphs of two dtypes never share
    a cache entry)."""
    if plan.dtype is None or plan.dtype == getattr(model.config, "dtype", None):
        return model
    if not any(f.name == "dtype" for f in fields(model.config)):
        raise PlanError(f"dtype: model {model.name} (family {model.family}) has no dtype to set")
    return Model(replace(model.config, dtype=plan.dtype), model.source)


class MemoryLimitError(PlanError):
    """A plan whose peak memory per rank exceeds the limit `build` was given. `peak` is the
    summary's peak, or a lower bound of it when the message says "at least" (a tied model's
    plan refused from its graph without a cut)."""

    def __init__(self, message: str, peak: int) -> None:
        super().__init__(message)
        self.peak = peak


def build(model: Model | str | Path | Mapping, plan: Plan | Mapping, *, memory_limit: int | None = None,
          nodes: bool = True, timing: bool = False, short: bool = False, memory: bool = True) -> Workload:
    """Every pass from the model description to the rank-class programs; with `memory_limit`
    (bytes per rank), MemoryLimitError before lowering when a rank class's peak exceeds it.
    `nodes=False` lowers the programs' stats and holes without their nodes: the summary
    without what only writing needs (stg.evaluate); `timing=True` lowers, instead of their
    nodes (whatever `nodes` says), the compact form the timed replay reads (what stg explore
    times). `short=True`, with `nodes=False` and no memory limit: the passes run on the
    model's short form where it has one (stg/short.py), which gives the same summary at a
    fraction of the cost; the workload's sharded graph is then the short model's.
    `memory=False`, without a memory limit: the rank classes' memory is not found (the
    workload's is empty), for a build that only times its pipeline slice."""
    with collector_paused():
        return _build(model, plan, memory_limit, nodes, timing, short=short, memory=memory)


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused: the passes make millions of objects and hardly
    a cycle, and each of its full collections scans every graph the process holds (a third of
    a new structure's time for llama3-405b). Cycles made meanwhile wait for the next collection."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        if not gc.get_freeze_count():  # (a caller's frozen objects stay frozen)
            # what the pause made is old at once: freeze() then unfreeze() moves every tracked
            # object to the oldest generation without scanning it, so the next young collection
            # does not walk the whole plan (a tenth of stg.evaluate's time), and the rare full
            # ones still find any cycle
            gc.freeze()
            gc.unfreeze()
        gc.enable()


def _build(model, plan, memory_limit: int | None, nodes: bool, timing: bool,
           lower_all: Callable[[list[Callable[[], RankProgram]]], list[RankProgram]] | None = None,
           short: bool = False, memory: bool = True) -> Workload:
    """build(); `lower_all` runs the rank classes' lowering jobs (default: each in turn)."""
    model = model if isinstance(model, Model) else load_model(model)
    plan = plan if isinstance(plan, Plan) else Plan.from_dict(plan)
    model = _in_dtype(model, plan)
    _check_fits(model, plan)
    mesh = plan.mesh()
    embeddings = embedding_plan(model, plan)
    stages = stage_plan(plan, model.layers, _block_costs(model, plan)) if plan.pp > 1 else None
    if plan.fp8 and not isinstance(model.config, TransformerConfig):
        raise PlanError(f"fp8: applies to transformer models, not {model.name} (family {model.family})")
    options = GraphOptions(plan.flash_attention, embeddings.groups if embeddings else None, plan.fp8,
                           plan.fp8_param_gather)
    # without nodes (or lowered for timing only), a plan shares the structure of plans whose
    # degrees are above 1 where its are 1 (unit_bound): it writes nothing that names an op
    units = frozenset(axis for axis, size in mesh.axes if size == 1 and axis in _WIDENED) \
        if (timing or not nodes) and isinstance(model.config, TransformerConfig) else frozenset()
    form = short_form(model, plan.vpp) if short and not nodes and not timing and memory_limit is None else None
    # (a tied model's short cuts all put the tied weight's readers on the stages of the real cut's)
    structure = structure_of(form.model, plan, options, form.stage_plans(stages)[0] if stages else None, units) \
        if form else structure_of(model, plan, options, stages, units)
    bindings = {
        **model.config.sizes(vocab_multiple=plan.make_vocab_divisible_by * plan.tp),
        B: plan.micro_batch * plan.data_ranks,
        S: plan.seq,
        ATTN_FRACTION: plan.attention_flops.fraction,
        CF: sympy.Rational(str(plan.capacity_factor)),
        LOAD: 1,
        **(embeddings.bindings() if embeddings else {}),
        **{axis_symbol(axis): size for axis, size in mesh.axes},
    }
    # what every rank of a stage shares sizes the collectives (slots padded to the widest);
    # each variant's own values size its compute and memory
    shared = Evaluator(bindings)
    variants, variant_axes, variant_map = _variants(plan, bindings, embeddings)
    evaluators = [Evaluator({**bindings, **variant}) if variant else shared for variant in variants]
    if memory_limit is not None and (uncut := uncut_passes(structure)) is not None:
        # A tied model's cut adds to its graph without a cut (one for every cut) only the tied
        # weights' copies, with their gradients and optimizer states: that graph's memory under
        # this cut bounds every stage's from below, and refuses most plans over the limit before
        # the cut's own passes (a search meets many cuts).
        _check_graph(model, plan, uncut, bindings)
        schedule = order(plan.schedule, plan.pp, plan.microbatches, plan.vpp)
        _refuse_over(memory_limit, _memories(uncut, plan, [stages] * plan.pp, schedule, variants, evaluators, shared),
                     "at least ")
    if memory_limit is not None and variants == [{}] and not passes_cached(structure) \
            and (held := held_leaves(structure)) is not None:
        # one stage of pp holds at least an even share of the weights and optimizer states:
        # a plan over the limit by that alone is refused before the structure's passes (a
        # schedule it cannot run is still said first)
        order(plan.schedule, plan.pp, plan.microbatches, plan.vpp)
        _refuse_peak(memory_limit, -(-sum(n * shared(nbytes) for nbytes, n in held.items()) // plan.pp), "at least ")
    sharded = symbolic_passes(structure)
    if form and any(used & form.interior for used in shared_leaves(sharded)):
        # a leaf that a block standing for several reads with others: counted on the real blocks
        form, structure = None, structure_of(model, plan, options, stages, units)
        sharded = symbolic_passes(structure)
    _check_graph(model, plan, sharded, bindings, form.stage_plans(None)[0] if form else None)
    pipelines = _short_pipelines(plan, sharded, stages, form) if form else \
        [_pipeline(model, plan, sharded, stages)] * plan.pp
    pipeline = pipelines[0]
    memories = _memories(sharded, plan, [p.stages for p in pipelines], pipeline.order, variants, evaluators, shared) \
        if memory or memory_limit is not None else []
    _refuse_over(memory_limit, memories)  # before the costly lowering
    sharded = unit_bound(structure, units) if units else sharded
    device, bucket_bytes = device_spec(plan.device), int(plan.bucket_mb * 2**20)
    # timing: a stage repeats the actions another stage ran, in this plan or in one that
    # differs only in its micro-batch count (a folded plan's probes, stg/explore/probe.py); it
    # takes those of other plans of the cut (another dp, tp, micro-batch size...) rebound to
    # its own sizes (ActionNodes.rebound)
    templates: dict[int, dict] = {}
    rebindable = None
    if timing:
        cut = (pipeline.stages, pipeline.split_backward, device, bucket_bytes)
        kept = _timing_templates(sharded, *cut, frozenset(shared.bindings.items()))
        templates = {id(evaluate): kept.setdefault(frozenset(evaluate.bindings.items()), {})
                     for evaluate in evaluators}
        rebindable = _rebindable_templates(sharded, *cut)
    # a pipeline stage alike to an earlier one: counting alone, it counts what that one counts;
    # timed, it repeats that one's templates (found without walking its names)
    alike = _alike_stages(model, plan, sharded, stages) if (timing or not nodes) and not form else {}
    counted = {} if timing else alike
    jobs = [partial(lower, sharded, evaluate, device, pipeline=pipelines[rank], bucket_bytes=bucket_bytes, rank=rank,
                    comm_evaluate=shared, keep_nodes=nodes, timing=timing, stage_templates=templates.get(id(evaluate)),
                    rebindable=rebindable, alike_to=alike.get(rank))
            for rank in range(plan.pp) if rank not in counted for evaluate in evaluators]  # one per rank class
    lowered, programs = iter(lower_all(jobs) if lower_all else [job() for job in jobs]), []
    for rank in range(plan.pp):
        like = counted.get(rank)
        programs += [next(lowered) for _ in evaluators] if like is None else \
            [_moved_count(programs[like * len(evaluators) + v], like, rank) for v in range(len(evaluators))]
    return Workload(model, plan, mesh, sharded, tuple(programs), tuple(memories), bindings, variant_axes,
                    variant_map, embeddings, stages)


@per_graph(limit=2)  # a folded plan's probes run one fold length's two micro-batch counts in turn
def _timing_templates(sharded: ShardedGraph, *key) -> dict:
    """Action templates of timed lowerings (stg/lower.py, stage_templates) by stage cut,
    backward split, device, bucket size and bindings (then by each variant's): what an
    action's nodes depend on but the schedule, whose actions' keys and shapes the templates
    are found by."""
    return {}


@per_graph
def _rebindable_templates(sharded: ShardedGraph, *key) -> dict:
    """Action templates of timed lowerings by stage cut, backward split, device and bucket
    size, whatever the plan's sizes (stg/lower.py, rebindable)."""
    return {}


def _alike_stages(model: Model, plan: Plan, sharded: ShardedGraph, stages: StagePlan | None) -> dict[int, int]:
    """Pipeline stages that count what an earlier stage counts, each with the first such
    stage: middle stages whose chunks hold as many blocks each, all of one run of alike
    blocks (stg/short.py: the same kind and neighbours' kinds; what a block adds to a
    summary depends on those alone, tests/test_short.py), so their actions, sends, step and
    buckets are alike -- but a stage holding a block that reads a leaf other blocks read."""
    form = short_form(model, plan.vpp) if stages is not None and plan.pp > 2 else None
    if form is None:
        return {}
    shared = frozenset().union(*shared_leaves(sharded))  # (a tied embedding's: the first and last stages')
    run_of = [k for k, run in enumerate(form.runs) for _ in range(run.first, run.last + 1)]
    starts = (*stages.first_block, model.layers + 2)
    first: dict[tuple, int] = {}
    alike = {}
    for rank in range(1, plan.pp - 1):
        chunks = [range(starts[stage], starts[stage + 1]) for stage in range(rank, stages.stages, plan.pp)]
        if all(chunk and run_of[chunk[0]] == run_of[chunk[-1]] and shared.isdisjoint(chunk) for chunk in chunks):
            like = first.setdefault(tuple((run_of[chunk[0]], len(chunk)) for chunk in chunks), rank)
            if like != rank:
                alike[rank] = like
    return alike


def _moved_count(program: RankProgram, stage: int, to: int) -> RankProgram:
    """A counted program of pipeline stage `stage` as stage `to` alike to it counts it: the
    same stats, its peers as many stages on (a middle stage's are its neighbours)."""
    def moved(hole):
        return RankHole(hole.stage + to - stage) if isinstance(hole, RankHole) and hole.stage is not None else hole
    return replace(program, key=(to,), counted_holes=frozenset(map(moved, program.counted_holes)))


def _check_graph(model: Model, plan: Plan, sharded: ShardedGraph, bindings: Mapping,
                 whole: StagePlan | None = None) -> None:
    """What the plan asks of the sharded graph: sp for routed experts, sizes that divide, a
    program that fits in memory, no ignored fields. `whole`: the short model's blocks weighed
    as the real model's (stg/short.py), when the graph is a short model's."""
    if plan.tp > 1 and not plan.sp and _routes_tokens(sharded):
        # without sp every tp rank holds every token and would route and compute them all;
        # Megatron-Core refuses MoE with tp but without sp for the same reason
        raise PlanError(f"sp: model {model.name} routes tokens to experts; with tp={plan.tp} it needs sequence "
                        "parallelism (--sp), so each tp rank routes its own tokens, as Megatron-Core requires")
    check_divisibility(sharded, bindings)
    _check_sensible(model, plan, sharded, whole)


def _memories(sharded: ShardedGraph, plan: Plan, stage_plans: list, schedule: Order, variants: list[dict],
              evaluators: list, shared: Evaluator) -> list[Memory]:
    """Per rank class (pipeline stage, then variant), its memory; `stage_plans`: the stage cut
    each pipeline stage reads (a short model's are its own, stg/short.py)."""
    # a variant whose symbols size no tensor (an expert slot's load) shares its stage's memory
    in_shapes = _shape_symbols(sharded)
    memories = []
    for rank in range(plan.pp):
        stage_memory, stages = None, stage_plans[rank]
        for variant, evaluate in zip(variants, evaluators):
            if in_shapes & set(variant):
                memories.append(memory(sharded, evaluate, stages, schedule.digest(rank).in_flight, rank))
            else:
                stage_memory = stage_memory or memory(sharded, shared, stages, schedule.digest(rank).in_flight, rank)
                memories.append(stage_memory)
    return memories


def _refuse_over(limit: int | None, memories: list[Memory], bound: str = "") -> None:
    """MemoryLimitError when a rank class's peak (`bound`: "at least ", a lower bound of it)
    exceeds `limit` bytes."""
    if limit is not None:
        _refuse_peak(limit, max(m.peak for m in memories), bound)


def _refuse_peak(limit: int, peak: int, bound: str = "") -> None:
    if peak > limit:
        raise MemoryLimitError(f"memory: peak {bound}{peak / 2**30:.1f} GiB per rank over the {limit / 2**30:.1f} "
                               "GiB usable", peak)


def _check_sensible(model: Model, plan: Plan, sharded: ShardedGraph, whole: StagePlan | None = None) -> None:
    """Refuse, before lowering, a program too large to hold in memory (every micro-batch is
    its own nodes: about the per-micro-batch ops of a stage times the micro-batches), and plan
    fields that would be silently ignored by this model."""
    weight = block_weight(whole)
    per_microbatch = sum(n * weight(layer) for layer, n in _work_ops(sharded).items()) // plan.pp
    if plan.microbatches * per_microbatch > MAX_NODES:
        raise PlanError(f"global_batch={plan.global_batch}: {plan.microbatches:,} micro-batches of about "
                        f"{per_microbatch:,} nodes each is more than {MAX_NODES:,} trace nodes per rank; "
                        "raise micro_batch or dp, or lower global_batch")
    for logical, _ in plan.rules or ():
        if logical not in (named := _logical_axes(sharded)):
            raise PlanError(f"rules: {logical}: model {model.name} has no logical axis {logical!r}; it has "
                            f"{', '.join(sorted(named))}")
    for name, default in (("capacity_factor", 1.0), ("expert_skew", 0.0)):
        if getattr(plan, name) != default and model.family not in ("mixtral", "deepseek") \
                and not _routes_tokens(sharded):
            raise PlanError(f"{name}: applies to mixture-of-experts models, not {model.name} (no experts)")


@per_graph
def _routes_tokens(sharded: ShardedGraph) -> bool:
    """Whether the graph routes tokens to experts."""
    return any(op.kind is OpKind.DISPATCH for op in sharded.graph.ops)


@per_graph
def _work_ops(sharded: ShardedGraph) -> Counter:
    """Per layer, its ops of one micro-batch that make a node (all but the step's and views)."""
    return Counter(op.layer for op in sharded.graph.ops if op.phase is not Phase.STEP and op.kind not in VIEWS)


@per_graph
def _logical_axes(sharded: ShardedGraph) -> frozenset[str]:
    return frozenset(chain.from_iterable(set(map(attrgetter("dims"), sharded.graph.tensors.values()))))


@per_graph
def _shared_weights(sharded: ShardedGraph) -> tuple[tuple[str, frozenset[int]], ...]:
    """The weights that ops of more than one layer read (the step's aside), with those layers:
    only these can be read on two stages."""
    shared = []
    for weight in sharded.graph.weights:
        layers = frozenset(op.layer for op in sharded.graph.consumers.get(weight.name, ()) if op.phase is not Phase.STEP)
        if len(layers) > 1:
            shared.append((weight.name, layers))
    return tuple(shared)


@per_graph
def _weight_on_stages(sharded: ShardedGraph, stages) -> tuple[str, list[int]] | None:
    """The first weight that ops of two stages read, and those stages (None: there is none)."""
    for name, layers in _shared_weights(sharded):
        used_on = {stages.virtual_stage(layer) for layer in layers}
        if len(used_on) > 1:
            return name, sorted(used_on)
    return None


@per_graph(limit=CUT_LIMIT)
def _cut(sharded: ShardedGraph, stages) -> tuple:
    return tuple(cut(sharded.graph, stages, crossings(sharded)))


@per_graph
def _shape_symbols(sharded: ShardedGraph) -> frozenset:
    shapes = {id(t.shape): t.shape for t in sharded.graph.tensors.values()}  # a block's copies share theirs
    dims = {dim for shape in shapes.values() for dim in shape}  # few distinct ones
    return frozenset(symbol for dim in dims for symbol in dim.free_symbols)


def _variants(plan: Plan, bindings, embeddings: EmbeddingPlan | None) -> tuple[list[dict], tuple, tuple]:
    """(per-variant bindings, the mesh axes that pick a rank's variant, coordinate -> variant)."""
    if embeddings is not None and embeddings.variant_axes:
        distinct, index = embeddings.variants
        return list(distinct), embeddings.variant_axes, index
    loads = expert_loads(plan, bindings.get(E))
    if len(loads) > 1:
        return [{LOAD: load} for load in loads], ("ep",), tuple(range(plan.ep))
    return [{}], (), ()


def embedding_plan(model: Model, plan: Plan) -> EmbeddingPlan | None:
    """The tables' sharding for a recommendation model (None for other models, which must
    not ask for one)."""
    asked = [k for k in ("embedding_sharding", "embeddings", "column_shards", "embedding_memory_gib")
             if getattr(plan, k) is not None] + (["local_world_size"] if plan.local_world_size > 1 else [])
    if not isinstance(model.config, DLRMConfig):
        if asked:
            raise PlanError(f"{asked[0]}: applies to models with embedding tables (family dlrm), not "
                            f"{model.name} (family {model.family})")
        return None
    for name in ("tp", "pp", "cp", "ep"):
        if getattr(plan, name) != 1:
            raise PlanError(f"{name}={getattr(plan, name)}: model {model.name} is a recommendation model; its dense "
                            "part is data parallel and its tables are sharded by embedding_sharding (use dp and "
                            "local_world_size)")
    if plan.recompute.value != "none" or plan.zero:
        raise PlanError(f"{'zero' if plan.zero else 'recompute'}: not supported for recommendation model {model.name}")
    if plan.world_size > MAX_EMBEDDING_RANKS:
        raise PlanError(f"dp*local_world_size = {plan.world_size:,}: the embedding planner places tables rank by "
                        f"rank; at most {MAX_EMBEDDING_RANKS:,} ranks for recommendation models")
    memory_gib = plan.embedding_memory_gib or device_spec(plan.device).memory_gib
    return plan_embeddings(model.config, default=plan.embedding_sharding, overrides=plan.embeddings,
                           hosts=plan.dp, local=plan.local_world_size, batch=plan.micro_batch * plan.data_ranks,
                           limit_bytes=int(memory_gib * 2**30), columns=plan.column_shards)


def expert_loads(plan: Plan, experts: int | None) -> list[sympy.Expr]:
    """Per expert-parallel slot, its load relative to balanced routing: expert e receives a
    share of the tokens proportional to 1 / (e + 1)^s (Zipf), and slot r holds the contiguous
    experts r E/ep .. (r + 1) E/ep - 1. [1] when routing is balanced."""
    if not plan.expert_skew or experts is None or plan.ep == 1:
        return [sympy.Integer(1)]
    weights = [sympy.Float(1.0 / (e + 1) ** plan.expert_skew, 17) for e in range(experts)]
    total, per_slot = sum(weights), experts // plan.ep
    return [plan.ep * sum(weights[r * per_slot:(r + 1) * per_slot]) / total for r in range(plan.ep)]


TAG_LIMIT = 400_000_000  # below ASTRA-sim's 500,000,000 limit on comm_tag


def _pipeline(model: Model, plan: Plan, sharded: ShardedGraph, stages) -> Pipeline:
    if stages is None:
        return Pipeline.single_stage(plan.microbatches)
    shared = _weight_on_stages(sharded, stages)
    if shared:  # e.g. an output layer tied to the embedding
        raise PlanError(f"pp={plan.pp}: weight {shared[0]} of model {model.name} is used on pipeline stages "
                        f"{shared[1]}; a weight shared across stages (tied embeddings) is not supported yet")
    pipeline = _on_cut(plan, sharded, stages)
    _check_tags(plan, len(pipeline.edges))
    return pipeline


def _on_cut(plan: Plan, sharded: ShardedGraph, stages) -> Pipeline:
    """The plan's schedule on the stage cut `stages` of `sharded`."""
    return Pipeline(stages, order(plan.schedule, plan.pp, plan.microbatches, plan.vpp),
                    plan.schedule in SPLIT_BACKWARD, _cut(sharded, stages))


def _check_tags(plan: Plan, edges: int) -> None:
    if plan.microbatches * edges >= TAG_LIMIT:
        raise PlanError(f"microbatches={plan.microbatches}: too many for unique send/recv tags below {TAG_LIMIT:,}")


def _short_pipelines(plan: Plan, sharded: ShardedGraph, stages, form: ShortForm) -> list[Pipeline]:
    """Per pipeline stage, its pipeline on the short model of `form` (stg/short.py): the
    real schedule on that stage's own cut of the short model."""
    if stages is None:
        return [replace(Pipeline.single_stage(plan.microbatches), stages=form.stage_plans(None)[0])]
    pipelines = [_on_cut(plan, sharded, cut) for cut in form.stage_plans(stages)]
    _check_tags(plan, _short_edges(plan, pipelines))
    return pipelines


def _short_edges(plan: Plan, pipelines: list[Pipeline]) -> int:
    """How many edges the real cut has, from each stage's cut of the short model: those
    between each of its virtual stages and an earlier one (each (tensor, reading stage) is an
    edge, and the blocks before a virtual stage are alike to the real ones)."""
    return sum(1 for rank, pipeline in enumerate(pipelines) for stage in range(rank, plan.pp * plan.vpp, plan.pp)
               for edge in pipeline.edges
               if stage in (edge.source, edge.target) and min(edge.source, edge.target) < stage)


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
    from stg.slice_check import check_slice  # the replay and its chakra reader: only where a set is written

    workload = build(model, plan)
    check_slice(workload)
    summary = workload.summary()
    write_trace_set(Path(out), workload, summary, progress, ranks=check_ranks(ranks, workload), workers=workers)
    return summary


def count(model: Model | str | Path | Mapping, plan: Plan | Mapping, *, workers: int = 1) -> dict:
    """Everything but the writing: the bytes and nodes a full set would have, with the summary;
    `workers` > 1 lowers the rank classes in that many forked processes."""
    counted: list = []

    def lower_all(jobs):
        programs, found = lower_counted(jobs, workers)
        counted.extend(found)
        return programs
    with collector_paused():
        workload = _build(model, plan, None, True, False, lower_all)
    return {**count_trace_set(workload, counted), "summary": workload.summary()}


def check_ranks(ranks: range | None, workload: Workload) -> range | None:
    world = workload.mesh.size
    if ranks is not None and not (0 <= ranks.start < ranks.stop <= world and ranks.step == 1):
        raise PlanError(f"ranks: {ranks.start}:{ranks.stop} is not a non-empty range within 0:{world}")
    return ranks
