"""The serving engine's programs: the inference step graph laid out once, lowered per step.

The step graph (the model's forward with a KV cache, stg/serve/step.py) goes through the same
passes as training, minus autodiff: tensor parallelism's layouts (heads, KV heads, MLP and
vocabulary split on tp; by default the residual stream is whole, so each block ends in an
ALL_REDUCE, as vLLM runs it; with `sp` it is split over tp by tokens, as Megatron's sequence
parallelism: a REDUCE_SCATTER after each block and an ALL_GATHER before the next, a step's
tokens padded to a multiple of tp), the redistribution rule table, pipeline cut into
send/recv pairs (one micro-batch per step), and lowering per pipeline stage. A step's shape
binds four symbols; every FLOP and byte follows from the local shapes.

Replicas (`replicas`, the CLI's --dp) are independent engines: the mesh's dp axis, each
replica a variant with its own iterations when their schedules differ.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace
from fractions import Fraction
from math import ceil

import sympy

from model_zoo import GraphOptions, Model
from parallelism import sharding_spec
from parallelism.pipeline import cut, stage_plan, untie
from stg.builder import GraphBuilder
from stg.device import DEFAULT_DEVICE, DEVICES, device_spec
from stg.errors import PlanError
from stg.graph import DType, Graph, OpKind, Role
from stg.lower import Evaluator, Pipeline, check_divisibility, lower
from stg.mesh import axis_symbol
from stg.plan import AttentionFlops, Plan
from stg.program import ClassStats, NodeType, RankHole, RankProgram, TraceNode
from stg.schedule import order
from stg.serve.scheduler import Policy
from stg.serve.step import StepShape
from stg.sharding import shard
from model_zoo.moe import CF, LOAD
from stg.symbols import ATTN_FRACTION, KV_TOKENS, PAIRS, SAMPLED, B, S

DTYPES = ("bf16", "fp8")
STEP_SYMBOLS = (S, KV_TOKENS, PAIRS, SAMPLED)


@dataclass(frozen=True)
class ServePlan:
    """How a model is served: parallel layout, dtypes, device, scheduler and KV cache, in
    vLLM's and Sarathi-Serve's vocabulary (the CLI's flags and the API's names are these)."""

    tp: int = 1
    pp: int = 1
    # expert parallelism: ep engines step together, each with its own scheduler and requests
    # (attention data-parallel), routed experts split over them, tokens dispatched by all-to-all
    ep: int = 1
    dp: int = 1  # independent replicas; requests are assigned round-robin in arrival order
    dtype: str = "bf16"  # weights
    kv_cache_dtype: str = "bf16"
    device: str = DEFAULT_DEVICE
    attention_flops: AttentionFlops = AttentionFlops.CAUSAL
    scheduler: Policy = Policy.SARATHI
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 256
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None  # overrides the planner
    # disaggregated serving (stg/serve/disagg.py): prefill and decode instances (0 and 0: every
    # replica does both), each kind with its own tp and pp (None: the plan's tp, pp), the plan's ep
    prefill_instances: int = 0
    decode_instances: int = 0
    prefill_tp: int | None = None
    prefill_pp: int | None = None
    decode_tp: int | None = None
    decode_pp: int | None = None
    # speculative decoding: a draft model (a zoo name or model file; same tp, on the first
    # pipeline stage's ranks, one copy per ep engine) proposes `speculative` tokens per decode in
    # as many steps, the target verifies them in one
    speculative: int = 0
    draft: str | None = None
    acceptance_rate: float = 0.7  # per draft token (stg/serve/scheduler.py: expected tokens)
    # sequence parallelism (Megatron's): the residual stream split over tp by tokens, each
    # block's all-reduce a reduce-scatter after it and an all-gather before the next
    sp: bool = False

    def __post_init__(self):
        for name in ("tp", "pp", "ep", "dp", "max_num_batched_tokens", "max_num_seqs", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise PlanError(f"{name}: must be a positive integer, got {value!r}")
        if not isinstance(self.sp, bool):
            raise PlanError(f"sp: must be true or false, got {self.sp!r}")
        if self.sp and self.tp == 1:
            raise PlanError("sp: sequence parallelism splits a step's tokens over tp, so it needs tp > 1")
        if self.num_kv_blocks is not None and (isinstance(self.num_kv_blocks, bool)
                                               or not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks <= 0):
            raise PlanError(f"num_kv_blocks: must be a positive integer, got {self.num_kv_blocks!r}")
        for name in ("prefill_instances", "decode_instances"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise PlanError(f"{name}: must be a whole number of instances, got {value!r}")
        for name in ("prefill_tp", "prefill_pp", "decode_tp", "decode_pp"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise PlanError(f"{name}: must be a positive integer, got {value!r}")
            if value is not None and not self.prefill_instances:
                raise PlanError(f"{name}: applies to disaggregated serving (prefill_instances, decode_instances)")
        if (self.prefill_instances > 0) != (self.decode_instances > 0):
            raise PlanError("prefill_instances and decode_instances: disaggregated serving needs both (or neither)")
        if self.prefill_instances and self.dp > 1:
            raise PlanError(f"dp={self.dp}: with prefill and decode instances the instances are the replicas; leave dp 1")
        if isinstance(self.speculative, bool) or not isinstance(self.speculative, int) or self.speculative < 0:
            raise PlanError(f"speculative: must be a whole number of draft tokens, got {self.speculative!r}")
        if self.speculative and self.draft is None:
            raise PlanError("speculative: needs a draft model (draft)")
        if self.speculative and self.prefill_instances:
            raise PlanError("speculative: not with prefill and decode instances (the draft's own KV cache would "
                            "have to move with the target's; not implemented)")
        for name in ("dtype", "kv_cache_dtype"):
            if getattr(self, name) not in DTYPES:
                raise PlanError(f"{name}: must be one of {list(DTYPES)}, got {getattr(self, name)!r}")
        if self.device not in DEVICES:
            raise PlanError(f"device: unknown device {self.device!r}; known: {', '.join(DEVICES)}")
        util = self.gpu_memory_utilization
        if isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 < util <= 1:
            raise PlanError(f"gpu_memory_utilization: must be in (0, 1], got {util!r}")
        for name, kind in (("attention_flops", AttentionFlops), ("scheduler", Policy)):
            value = getattr(self, name)
            if not isinstance(value, kind):
                try:
                    object.__setattr__(self, name, kind(value))
                except ValueError:
                    raise PlanError(f"{name}: must be one of {[m.value for m in kind]}, got {value!r}") from None

    def parallel(self) -> Plan:
        """The layout part as a training Plan (one replica): what the sharding rules read."""
        # dp = ep: the ep engines are data parallel for attention (Megatron-Core's folding);
        # etp = tp: every expert's FFN split over tp like a dense MLP (vLLM's default for MoE)
        return Plan(tp=self.tp, pp=self.pp, ep=self.ep, dp=self.ep, etp=self.tp, sp=self.sp, device=self.device,
                    attention_flops=self.attention_flops, schedule="gpipe")

    def instance_plan(self, kind: str) -> "ServePlan":
        """The plan of a prefill or decode instance: its own tp and pp (the plan's by default)."""
        tp, pp = getattr(self, f"{kind}_tp"), getattr(self, f"{kind}_pp")
        return replace(self, tp=self.tp if tp is None else tp, pp=self.pp if pp is None else pp, prefill_tp=None,
                       prefill_pp=None, decode_tp=None, decode_pp=None, prefill_instances=0, decode_instances=0)

    def to_dict(self) -> dict:
        return {**{k: getattr(self, k) for k in self.__dataclass_fields__},
                "attention_flops": self.attention_flops.value, "scheduler": self.scheduler.value}


def cast_weights(graph: Graph, dtype: DType) -> Graph:
    """The same graph with every weight stored in `dtype`; each op's bytes re-derived."""
    b = GraphBuilder()
    for t in graph.tensors.values():
        if t.name not in graph.producer:
            b.tensors[t.name] = replace(t, dtype=dtype) if t.role is Role.WEIGHT else t
    for op in graph.ops:
        b.layer = op.layer
        b.add_op(op.name, op.kind, op.inputs, [graph.tensors[o] for o in op.outputs], dict(op.attrs), phase=op.phase)
    return b.build()


class StepEvaluator(Evaluator):
    """Binds one step's symbols. Each expression is compiled once per engine into a polynomial
    in the step symbols with exact rational coefficients; a step evaluates it with integers."""

    def __init__(self, compiled: dict, static: dict, shape: StepShape):
        self.compiled, self.static = compiled, static
        self.values = tuple(shape.bindings()[s] for s in STEP_SYMBOLS)

    def __call__(self, expr: sympy.Expr) -> int:
        terms = self.compiled.get(expr)
        if terms is None:
            terms = self.compiled[expr] = _polynomial(sympy.sympify(expr).xreplace(self.static))
        if not isinstance(terms, list):  # not a polynomial (a ceiling, a min): bind it directly
            return int(sympy.ceiling(terms.xreplace(dict(zip(STEP_SYMBOLS, self.values)))))
        total = Fraction(0)
        for coefficient, powers in terms:
            term = coefficient
            for value, power in zip(self.values, powers):
                if power:
                    term *= value ** power
            total += term
        return ceil(total)


def _polynomial(expr: sympy.Expr):
    try:
        poly = sympy.Poly(expr, *STEP_SYMBOLS)
    except sympy.PolynomialError:
        return expr
    if not all(c.is_Rational for c in poly.coeffs()):
        return expr
    return [(Fraction(int(c.p), int(c.q)), powers) for powers, c in poly.terms()]


class Engine:
    """One replica's programs: per pipeline stage, the lowered program of a step shape."""

    def __init__(self, model: Model, plan: ServePlan, cache_size: int = 64, lag: int = 1):
        self.model, self.plan = model, plan
        self.lag = lag  # steps in flight through the pipeline (the first stage's tokens arrive lag - 1 steps late)
        if plan.ep > 1 and getattr(model.config, "experts", None) is None:
            raise PlanError(f"ep={plan.ep}: model {model.name} has no experts to split")
        parallel = plan.parallel()
        graph = model.forward_graph(GraphOptions(kv_cache=plan.kv_cache_dtype))
        if plan.dtype != "bf16":
            graph = cast_weights(graph, DType.parse(plan.dtype))
        stages = stage_plan(parallel, model.layers) if plan.pp > 1 else None
        if stages is not None:  # a weight read on two stages (tied embeddings): a copy on each
            graph, _ = untie(graph, stages)
        self.sharded = shard(graph, sharding_spec(parallel))
        mesh = parallel.mesh()
        self.static = {sympy.sympify(k): sympy.sympify(v) for k, v in {
            **model.config.sizes(vocab_multiple=plan.tp), CF: 1, LOAD: 1, B: plan.ep, ATTN_FRACTION: 1,
            **{axis_symbol(axis): size for axis, size in mesh.axes}}.items()}
        self.pad = plan.tp if plan.sp else 1  # a step's tokens, padded to split evenly under sp
        check_divisibility(self.sharded, {**self.static, **StepShape(self.pad, 1, 1, 1).bindings()})
        if stages is None:
            self.pipeline = Pipeline.single_stage(1)
        else:
            self.pipeline = Pipeline(stages, order("gpipe", plan.pp, 1, 1), False,
                                     tuple(cut(self.sharded.graph, stages)))
        self.device = device_spec(plan.device)
        self.compiled: dict = {}
        self.cache: OrderedDict = OrderedDict()
        self.cache_size = cache_size
        self.templates: dict = {}

    @property
    def edges(self) -> int:
        """Send/recv tags per step: the pipeline's edges, and the sampled tokens' way back."""
        return len(self.pipeline.edges) + (self.plan.pp > 1)

    def evaluator(self, shape: StepShape) -> StepEvaluator:
        return StepEvaluator(self.compiled, self.static, shape)

    def program(self, shape: StepShape, stage: int) -> RankProgram:
        """Stage `stage`'s program for one step of this shape (steps of one shape share it)."""
        key = (shape, stage)
        if key in self.cache:
            self.cache.move_to_end(key)
            return self.cache[key]
        program = lower(self.sharded, self.evaluator(shape), self.device, pipeline=self.pipeline,
                        bucket_bytes=1 << 62, rank=stage)
        self.cache[key] = program
        if len(self.cache) > self.cache_size:
            self.cache.popitem(last=False)
        return program

    def template(self, stage: int, variant: str = "steady"):
        """Stage `stage`'s iteration as a StageTemplate (stg/serve/template.py), built once.
        Variants of the first stage under pp with iterations in flight (`lag` > 1): "warmup",
        its first lag - 1 iterations (no tokens to receive yet), and "tail", the tokens of the
        last lag - 1 iterations received after them."""
        key = (stage, variant)  # variant: "steady", "warmup" or ("tail", receipts)
        if key not in self.templates:
            from stg.serve.template import build_template

            def lowered(evaluate):
                if isinstance(variant, tuple):
                    return self._tail(evaluate, variant[1])
                program = lower(self.sharded, evaluate, self.device, pipeline=self.pipeline, bucket_bytes=1 << 62,
                                rank=stage)
                return program if variant == "warmup" else self._token_feedback(program, stage, evaluate)

            self.templates[key] = build_template(lowered, self.static, StepShape(8 * self.pad, 64, 100, 2),
                                                 (S, KV_TOKENS, PAIRS, SAMPLED), self.pad)
        return self.templates[key]

    def _tokens_bytes(self, evaluate) -> int:
        """The sampled token ids a step sends back: int64, padded to max_num_seqs (x K + 1 under
        speculation), one size for every step, as a receive may be posted before its step is known."""
        return evaluate(sympy.Integer(self.plan.max_num_seqs * (self.plan.speculative + 1) * 8))

    def _token_feedback(self, program: RankProgram, stage: int, evaluate) -> RankProgram:
        """Under pp the next step of an engine needs its sampled tokens (its decodes' inputs) on
        the first stage: the last stage sends them once it has sampled, and the first stage ends
        each step by receiving those of the step `lag` - 1 before it, a zero-cost node joining
        them into its compute chain (vLLM sends them from the last pipeline rank to the first;
        with lag = pp, pp virtual engines' steps are in flight at once)."""
        last = self.plan.pp - 1
        if self.plan.pp == 1 or stage not in (0, last):
            return program
        nodes = list(program.nodes)
        compute = max(i for i, n in enumerate(nodes) if n.type is NodeType.COMP_NODE)
        comm = [i for i, n in enumerate(nodes) if n.type is not NodeType.COMP_NODE]
        tag = len(self.pipeline.edges)
        if stage == last:
            size = self._tokens_bytes(evaluate)
            deps = tuple(sorted({compute, *comm[-1:]}))
            nodes.append(TraceNode(len(nodes), "send sampled tokens", NodeType.COMM_SEND_NODE, deps, comm_bytes=size,
                                   src=RankHole(), dst=RankHole(0), tag=tag))
            return RankProgram(program.key, tuple(nodes), program.stats)
        return self._receive(nodes, [tag - (self.lag - 1) * self.edges], (compute,), evaluate, program)

    def _receive(self, nodes, tags, deps, evaluate, program) -> RankProgram:
        """Receipts of sampled tokens (one evaluated size each, as the template records them)
        and the node that joins them into the compute chain."""
        first = len(nodes)
        for tag in tags:
            nodes.append(TraceNode(len(nodes), "recv sampled tokens", NodeType.COMM_RECV_NODE, deps,
                                   comm_bytes=self._tokens_bytes(evaluate), src=RankHole(self.plan.pp - 1),
                                   dst=RankHole(), tag=tag))
        evaluate(0), evaluate(0)
        nodes.append(TraceNode(len(nodes), "sampled tokens in", NodeType.COMP_NODE,
                               (*deps, *range(first, len(nodes))), op_type="tokens"))
        return RankProgram(program.key if program else (0,), tuple(nodes), program.stats if program else ClassStats())

    def _tail(self, evaluate, receipts: int) -> RankProgram:
        """The first stage's receipt of the last `receipts` steps' tokens (min(N, lag - 1)),
        written as step N (the number of steps): receipt i's tag names step N - receipts + i."""
        tags = [len(self.pipeline.edges) + (i - receipts) * self.edges for i in range(receipts)]
        return self._receive([], tags, (), evaluate, None)

    def sequence(self, stage: int, steps: int) -> list:
        """The templates of `steps` steps of `stage` in order (the first stage's warm-up and tail
        under a lag), each paired with whether it is one of the steps (the tail is not)."""
        if stage or self.lag == 1 or self.plan.pp == 1:
            return [(self.template(stage), True)] * steps
        warm = min(steps, self.lag - 1)
        return ([(self.template(0, "warmup"), True)] * warm + [(self.template(0), True)] * (steps - warm)
                + ([(self.template(0, ("tail", warm)), False)] if steps else []))

    def stage_ops(self, stage: int):
        stages = self.pipeline.stages
        return [op for op in self.sharded.graph.ops if stages.virtual_stage(op.layer) == stage]

    def kv_bytes_per_token(self, stage: int) -> int:
        """KV cache bytes one token takes on a rank of `stage`: its layers' K and V shards."""
        ev = self.evaluator(StepShape(1, 1, 1, 1))
        caches = {name for op in self.stage_ops(stage) if op.kind is OpKind.ATTENTION
                  for name in op.inputs[1 + op.attrs["new"]:]}
        return sum(ev(self.sharded.graph.tensors[name].nbytes) for name in caches)

    def weight_bytes(self, stage: int) -> int:
        ev = self.evaluator(StepShape(1, 1, 1, 1))
        used = {name for op in self.stage_ops(stage) for name in op.inputs}
        return sum(ev(t.nbytes) for t in self.sharded.graph.weights if t.name in used)

    def activation_reserve(self, stage: int) -> int:
        """Activation memory kept free for one budget-sized step without cache (what vLLM's
        profiling run measures): the residual stream of max_num_batched_tokens tokens plus
        the largest op's activation inputs and outputs (Nout = min(budget, max_num_seqs))."""
        plan = self.plan
        budget = plan.max_num_batched_tokens
        ev = self.evaluator(StepShape(budget, 0, 0, min(budget, plan.max_num_seqs)))
        tensors = self.sharded.graph.tensors
        largest = max(sum(ev(tensors[n].memory_bytes) for n in (*op.inputs, *op.outputs)
                          if tensors[n].role is Role.ACTIVATION) for op in self.stage_ops(stage))
        residual = ev(tensors["embed"].nbytes) if "embed" in tensors else 0
        return largest + residual
