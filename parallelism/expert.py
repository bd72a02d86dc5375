"""Expert parallelism: the routed experts split over ep, carved out of the data-parallel ranks.

Megatron-Core's convention: the ranks that hold one copy of the dense model (dp x ep of them,
in the mesh order pp, dp, ep, cp, tp) all take different data, so the batch is split over
dp and ep; the experts are split over ep only. Then, from the layouts alone:
  - dispatch puts each token in its expert's buffer on its own rank (buffers split by
    origin) and the experts' einsums need them split by expert: an ALL_TO_ALL over ep, and
    the same back for the combine (and both again in the backward);
  - dense weight gradients contract the batch over dp and ep: reduced over dp x ep;
  - expert weight gradients contract only the tokens of their dp replica: reduced over dp,
    the expert-data-parallel group;
  - with tensor parallelism (and sequence parallelism), each tp rank routes its own tokens
    and the experts are not split by tp (etp = 1): their gradients also reduce over tp.
ep must divide the experts (a clear error otherwise), and the batch must divide dp x ep.
"""

from __future__ import annotations

from stg.plan import Plan


def rules(plan: Plan) -> dict[str, dict[str, tuple[str, ...]]]:
    return {"data": {"batch": ("ep",)}, "params": {"expert": ("ep",)}}
