"""Context parallelism: the sequence is split over cp for the whole layer.

Only the inputs are split (seq -> cp); the rest follows. Attention's score einsum meets
queries split on s and keys split on t along the same axis, so keys and values are gathered
over cp (the all-gather form of Megatron's and Llama 3's context parallelism), and their
gradients come back as partial sums, reduce-scattered. Weight gradients contract the
sequence too, so they are Partial(dp, cp) and reduce over dp x cp in one collective.
"""

from __future__ import annotations

from stg.plan import Plan


def rules(plan: Plan) -> dict[str, dict[str, tuple[str, ...]]]:
    return {"data": {"seq": ("cp",)}}
