"""Tensor parallelism (Megatron-LM), with sequence parallelism.

Weights are split on their head, MLP and vocabulary dimensions. A weight [embed, mlp] with
mlp -> tp is then column-parallel and [mlp, embed] row-parallel without being told: the
row-parallel output is Partial(tp) and the residual stream needs it whole, so an ALL_REDUCE
appears (forward), and the input gradients of column-parallel layers likewise (backward).
The embedding and output layer are vocabulary-parallel, with Megatron's vocabulary-parallel
cross-entropy (its per-token statistics are all-reduced, not the logits gathered).

Sequence parallelism (on by default with tp, as Megatron) lays the residual stream out
split on seq over tp: the all-reduces become a REDUCE_SCATTER into the stream and an
ALL_GATHER out of it, in both directions.
"""

from __future__ import annotations

from stg.plan import Plan


def rules(plan: Plan) -> dict[str, dict[str, tuple[str, ...]]]:
    split = {"params": {"kv_heads": ("tp",), "heads": ("tp",), "mlp": ("tp",), "vocab": ("tp",)}}
    # at tp=1 the split is moot (tp is out of play, its rules dropped) unless tp is widened
    # (sharding_spec): then the structure is that of tp > 1 with sp, Megatron's default
    if plan.sp or plan.tp == 1:
        split["residual"] = {"seq": ("tp",)}
    return split
