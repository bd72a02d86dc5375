"""Expert parallelism: the routed experts split over ep, carved out of the data-parallel ranks.

Megatron-Core's convention ("parallel folding"): the plan's dp ranks all take different data
and ep of them share one copy of the experts. The mesh splits dp into two axes, ep and
dp/ep (mesh axis `dp`: the experts' data-parallel replicas), in the order pp, dp, ep, cp, tp,
so the batch is split over mesh dp and ep and the experts over ep only. Rank order: rank =
t + tp*(c + cp*(e + ep*d)) on a stage; Megatron-Core's dense data-parallel index is e + ep*d,
so dense groups are the same ranks as Megatron-Core's (order tp-cp-ep-dp-pp). With cp = 1 its
expert groups (etp = tp, then ep, then expert-dp) are the same ranks too; with cp > 1
Megatron-Core folds ep over cp x dp (cp first) while stg folds it over dp only (ep must
divide dp): the same group sizes, other members. Then, from the layouts alone:
  - dispatch puts each token in its expert's buffer on its own rank (buffers split by
    origin) and the experts' einsums need them split by expert: an ALL_TO_ALL over ep, and
    the same back for the combine (and both again in the backward);
  - dense weight gradients contract the batch over dp and ep: reduced over mesh dp x ep
    (the plan's dp ranks; x cp with context parallelism);
  - expert weight gradients contract only the tokens of their replica: reduced over mesh dp
    (x cp), the expert-data-parallel group of dp * cp / ep ranks;
  - with tensor parallelism (and sequence parallelism) and etp = 1, each tp rank routes its
    own tokens to whole experts: expert gradients also reduce over tp;
  - with etp = tp (Megatron-Core's --expert-tensor-parallel-size, whose default is tp), each
    expert's MLP dimension is split over tp (column-split gate/up, row-split down): the
    received tokens are all-gathered over tp after the dispatch all-to-all, the experts'
    partial outputs reduce-scattered over tp before the combine all-to-all (Megatron-Core's
    alltoall dispatcher), and expert gradients reduce over the expert-data-parallel group
    only. Expert ranks are then t + tp*(e + ep*d), Megatron-Core's expert order with
    etp = tp. Other etp sizes re-fold tp with the data-parallel ranks: not implemented.
ep must divide the experts and dp (clear errors otherwise), and the batch must divide dp.
"""

from __future__ import annotations

from stg.plan import Plan


def rules(plan: Plan) -> dict[str, dict[str, tuple[str, ...]]]:
    params = {"expert": ("ep",)}
    if plan.etp > 1:  # etp = tp: each expert's MLP dimension over the tp ranks
        params["expert_mlp"] = ("tp",)
    return {"data": {"batch": ("ep",)}, "params": params}
