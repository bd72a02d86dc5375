"""KV-cache sizes and the memory planner: how many cache blocks fit on a rank.

KV bytes per token per layer: grouped-query attention keeps a key and a value per KV head,
2 x kv_heads x head_dim x dtype bytes (4,096 for Llama 3 8B in bf16); multi-head latent
attention keeps the compressed latent and the shared rotary key, (kv_lora_rank +
qk_rope_head_dim) x dtype bytes (DeepSeek-V2/V3, as vLLM's MLA backend caches them).

The pool (vLLM's rule, with an activation reserve instead of a profiling run):

  blocks = floor((memory x gpu_memory_utilization - weights per rank - activation reserve)
                 / (block_size x KV bytes per token per rank))

taken on every pipeline stage, the smallest wins (every stage holds every request's cache for
its layers). `num_kv_blocks` overrides it.
"""

from __future__ import annotations

from dataclasses import dataclass

from stg.errors import PlanError
from stg.graph import DType


def kv_bytes_per_token_per_layer(config, kv_dtype: str = "bf16") -> int:
    """From the model's sizes, independently of the graph (the graph's cache tensors agree)."""
    nbytes = DType.parse(kv_dtype).nbytes
    if getattr(config, "attention", "gqa") == "mla":
        return (config.kv_lora_rank + config.qk_rope_head_dim) * nbytes
    head_dim = config.head_dim or config.hidden // config.heads
    return 2 * config.kv_heads_count * head_dim * nbytes


def pool_blocks(memory_bytes: int, utilization: float, weight_bytes: int, reserve_bytes: int, block_size: int,
                kv_bytes_per_token: int) -> int:
    """The formula above for one rank (may be <= 0: nothing fits)."""
    free = int(memory_bytes * utilization) - weight_bytes - reserve_bytes
    return free // (block_size * kv_bytes_per_token)


@dataclass(frozen=True)
class KVPlan:
    blocks: int
    block_size: int
    kv_bytes_per_token: int  # per rank (its stage's layers, its KV heads)
    per_stage: tuple[dict, ...]  # what each stage's formula saw
    overridden: bool

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size

    def max_requests(self, tokens_per_request: int) -> int:
        """Requests of that many tokens (prompt + output) that fit at once."""
        return self.blocks // -(-tokens_per_request // self.block_size)

    def to_dict(self) -> dict:
        return {"blocks": self.blocks, "block_size": self.block_size, "tokens": self.tokens,
                "kv_bytes_per_token_per_rank": self.kv_bytes_per_token, "overridden": self.overridden,
                "stages": list(self.per_stage)}


def plan_kv_cache(engine, draft=None) -> KVPlan:
    """The pool of `engine` (stg/serve/engine.py) on its device; with a speculative `draft`
    engine on the same ranks, its weights and its cache per token count too."""
    plan = engine.plan
    memory = int(engine.device.memory_gib * 2**30)
    stages = []
    for stage in range(plan.pp):
        weights, reserve = engine.weight_bytes(stage), engine.activation_reserve(stage)
        per_token = engine.kv_bytes_per_token(stage)
        if draft is not None and stage == 0:  # the draft runs on the first stage's ranks
            weights += draft.weight_bytes(0)
            reserve = max(reserve, draft.activation_reserve(0))
            per_token += draft.kv_bytes_per_token(0)
        blocks = pool_blocks(memory, plan.gpu_memory_utilization, weights, reserve, plan.block_size, per_token)
        stages.append({"stage": stage, "memory_bytes": memory, "weight_bytes": weights,
                       "activation_reserve_bytes": reserve, "kv_bytes_per_token": per_token, "blocks": blocks})
    smallest = min(stages, key=lambda s: s["blocks"])
    if plan.num_kv_blocks is not None:
        return KVPlan(plan.num_kv_blocks, plan.block_size, smallest["kv_bytes_per_token"], tuple(stages), True)
    if smallest["blocks"] <= 0:
        raise PlanError(f"gpu_memory_utilization: {plan.gpu_memory_utilization} of {engine.device.memory_gib} GiB "
                        f"leaves no room for a KV cache on stage {smallest['stage']} (weights "
                        f"{smallest['weight_bytes'] / 2**30:.1f} GiB, activation reserve "
                        f"{smallest['activation_reserve_bytes'] / 2**30:.2f} GiB); raise tp or pp, or use dtype fp8")
    return KVPlan(smallest["blocks"], plan.block_size, smallest["kv_bytes_per_token"], tuple(stages), False)
