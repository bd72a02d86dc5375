"""Conservation laws a generated set must obey, each derived from the plan, not from stg's output.

- FLOPs: forward + backward work summed over all ranks equals one rank doing the same global
  batch alone (recompute's re-run forward reported apart, the optimizer excluded: ZeRO shards it).
- Weights: what the ranks of one model replica store adds up to the model's parameters, each
  counted once per rank that holds a whole copy of it: weights with a head, MLP or vocabulary
  dimension are split over tp (Megatron), others replicated on every tp rank; expert weights
  split over ep (and over tp with etp = tp), others replicated (ZeRO-3: flat shards over every data-parallel rank, ep
  included); a tied output layer has one more copy on the last stage.
- Pipeline: per micro-batch, a stage sends the residual stream [micro-batch, seq, hidden] in
  its local layout (seq split over tp with sequence parallelism, over cp) to the next virtual
  stage, and its gradient back to the previous one.
- ZeRO (dense models, data parallel only, one micro-batch): per step and rank, the ring bytes
  of the data-parallel collectives are 2(n-1)/n Psi for stages 0-2 (all-reduce; or
  reduce-scatter + all-gather) and 3(n-1)/n Psi for stage 3 (gather forward, gather
  backward, reduce-scatter), less the backward gather of weights the backward does not read
  (tables, biases, norm shifts) (Rajbhandari et al. 2020, section 7: "2Psi" and "3Psi").
"""

from __future__ import annotations

import sympy

from stg.api import Workload, build
from stg.plan import Plan
from stg.program import NodeType
from stg.redistribute import Collective

TP_SPLIT = {"heads", "kv_heads", "mlp", "vocab"}  # parallelism/tensor.py: Megatron's split
RING = {Collective.ALL_REDUCE: lambda n: 2 * (n - 1) / n, Collective.REDUCE_SCATTER: lambda n: (n - 1) / n,
        Collective.ALL_GATHER: lambda n: n - 1, Collective.ALL_TO_ALL: lambda n: (n - 1) / n}
_ALONE: dict = {}


def _flops(workload: Workload) -> tuple[int, int, int]:
    """(forward+backward FLOPs, of which recompute, matmul FLOPs) summed over all ranks."""
    classes = workload.summary()["rank_classes"]
    return tuple(sum(c["count"] * c[key] for c in classes)
                 for key in ("flops_forward_backward", "flops_recompute", "matmul_flops_forward_backward"))


def single_rank_flops(model, plan: Plan) -> tuple[int, int, int]:
    """One rank, the same global batch, sequence and model options, no parallelism."""
    alone = Plan(micro_batch=plan.micro_batch, global_batch=plan.global_batch, seq=plan.seq,
                 attention_flops=plan.attention_flops, flash_attention=plan.flash_attention,
                 capacity_factor=plan.capacity_factor)
    key = (repr(model), repr(alone))
    if key not in _ALONE:
        _ALONE[key] = _flops(build(model, alone))
    return _ALONE[key]


def check_flops(model, plan: Plan, workload: Workload, rel: float = 0.0) -> None:
    """Every contraction is split, never repeated: matmul FLOPs are conserved exactly (without
    recompute; `rel` for routing skew's rounded loads). Other work may be repeated, at most
    once per extra tp rank -- norms, dropout and residual adds on every tp rank without
    sequence parallelism (as Megatron); within 1 % otherwise -- the vocabulary-parallel loss's
    per-token statistics on every tp rank, a tied weight's gradient contributions added on
    each rank that holds a copy."""
    total, recomputed, matmul = _flops(workload)
    alone, _, alone_matmul = single_rank_flops(model, plan)
    if plan.recompute.value == "none":
        assert recomputed == 0
        assert abs(matmul - alone_matmul) <= rel * alone_matmul, ("matmul", matmul, alone_matmul)
    repeated = (plan.tp - 1) * (alone - alone_matmul) if plan.tp > 1 and not plan.sp else 0
    slack = max(rel, 0.01) * alone
    assert alone - slack <= total - recomputed <= alone + repeated + slack, (total - recomputed, alone, repeated)


def _weights(workload: Workload):
    return [t for t in workload.model.graph.tensors.values() if t.role.value == "weight"]


def _value(expr, workload: Workload) -> int:
    return int(sympy.sympify(expr).xreplace(workload.bindings))


def check_weights(workload: Workload) -> None:
    sizes = workload.mesh.sizes
    tp, ep, pp = sizes.get("tp", 1), sizes.get("ep", 1), sizes.get("pp", 1)
    forward = workload.model.graph
    last = workload.model.layers + 1
    expected = 0
    # a pipeline keeps ZeRO-3's parameters whole through the step (torch.distributed.pipelining
    # with FSDP; TorchTitan's reshard_after_forward = not pp_enabled)
    zero3 = workload.plan.zero == 3 and pp == 1
    for w in _weights(workload):
        # ZeRO-3 shards dense weights over all their data-parallel ranks, ep included
        expert = "expert" in w.dims  # with etp = tp also split on their MLP dimension over tp
        split_tp = TP_SPLIT & set(w.dims) or (expert and workload.plan.etp > 1)
        copies = (1 if split_tp else tp) * (1 if expert or zero3 else ep)
        layers = {op.layer for op in forward.consumers.get(w.name, ())}
        if pp > 1 and 0 in layers and last in layers:  # tied: one more copy on the last stage
            copies *= 2
        expected += copies * _value(w.numel, workload) * w.dtype.nbytes
    flat = sizes.get("dp", 1) * sizes.get("cp", 1) if zero3 else 1
    replicas = workload.mesh.size // (tp * ep * pp * flat)
    classes = workload.summary()["rank_classes"]
    stored = sum(c["count"] * c["memory"]["weights"] for c in classes) // replicas
    # ZeRO-3's flat shards are padded per tensor to a multiple of the shard count
    slack = flat * len(_weights(workload)) * 2 * 4 if zero3 else 0
    assert expected <= stored <= expected + slack, (stored, expected)


def check_pipeline_sends(workload: Workload) -> None:
    plan, sizes = workload.plan, workload.mesh.sizes
    pp, vpp = plan.pp, plan.vpp
    hidden = workload.bindings[sympy.Symbol("H", positive=True, integer=True)]
    local_seq = plan.seq // (plan.tp if plan.sp else 1) // sizes.get("cp", 1)
    boundary = plan.micro_batch * local_seq * hidden * 2  # bf16 activations
    last = pp * vpp - 1
    for stage in range(pp):
        virtual = [chunk * pp + stage for chunk in range(vpp)]
        crossings = sum(v < last for v in virtual) + sum(v > 0 for v in virtual)
        program = workload.programs[stage * workload.variants]
        assert program.stats.send_bytes == plan.microbatches * crossings * boundary, (stage, program.stats.send_bytes)


def zero_ring_bytes(workload: Workload) -> float:
    """Ring bytes of rank 0's collectives over the data-parallel axis, per step."""
    n = workload.mesh.sizes["dp"]
    program = workload.programs[0]
    return sum(RING[node.collective](n) * node.comm_bytes for node in program.nodes
               if node.type is NodeType.COMM_COLL_NODE and node.group.axes == ("dp",))


def check_zero(workload: Workload) -> None:
    """Dense model, dp only (tp, cp, pp 1), one micro-batch: ring traffic as the ZeRO paper's."""
    plan = workload.plan
    n = workload.mesh.sizes["dp"]
    weights = _weights(workload)
    psi = sum(_value(w.numel, workload) * w.dtype.nbytes for w in weights)
    # the backward gathers only weights it reads: what multiplies (a matmul's operand, a
    # norm's scale), not a lookup table, a bias or a norm's shift, whose gradients need only
    # the output gradient
    forward = workload.model.graph
    read = lambda w, op: op.kind.value == "einsum" or (op.kind.value == "norm" and op.inputs.index(w.name) == 1)
    unread = sum(_value(w.numel, workload) * w.dtype.nbytes for w in weights
                 if not any(read(w, op) for op in forward.consumers.get(w.name, ())))
    factor = (n - 1) / n
    expected = 2 * factor * psi if plan.zero < 3 else factor * (3 * psi - unread)
    # ZeRO's flat shards are padded to a multiple of n per bucket
    assert abs(zero_ring_bytes(workload) - expected) <= n * 64 * 8, (zero_ring_bytes(workload), expected)
