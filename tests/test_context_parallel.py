"""Context parallelism: the sequence split over cp for the whole layer, keys and values
all-gathered (the all-gather form of Megatron's and Llama 3's context parallelism)."""

from helpers import block_collectives, op_flops
from stg import Plan, build

B, S = 2, 32


def test_keys_and_values_are_gathered_and_their_gradients_scattered(tiny_llama):
    cp = 2
    workload = build(tiny_llama, Plan(cp=cp, micro_batch=B, seq=S))
    found = block_collectives(workload, 2)
    kv_heads, head_dim = tiny_llama["kv_heads"], tiny_llama["hidden"] // tiny_llama["heads"]
    kv_shard = B * S // cp * kv_heads * head_dim * 2  # one rank's keys (or values), bf16
    assert found[("F", "ALL_GATHER", kv_shard)] == 2  # K and V before attention
    assert found[("B", "ALL_GATHER", kv_shard)] == 2  # again in the backward: not kept
    assert found[("B", "REDUCE_SCATTER", kv_shard * cp)] == 2  # dK, dV partial sums, scattered at once
    assert not any(kind == "ALL_REDUCE" and phase != "S" for phase, kind, _ in found)


def test_weight_gradients_reduce_over_dp_and_cp_in_one_group(tiny_llama):
    workload = build(tiny_llama, Plan(dp=2, cp=2, global_batch=4, micro_batch=B, seq=S))
    step = [op for op in workload.sharded.graph.ops if op.phase.value == "S" and op.kind.value == "collective"]
    assert step and all(op.attrs["axes"] == ("dp", "cp") for op in step)


def test_flops_over_the_cp_group_equal_one_rank(tiny_llama):
    """Attention with local queries against gathered keys does 1/cp of the work; every op is
    split evenly, except the loss's per-token arithmetic which is too."""
    one = op_flops(build(tiny_llama, Plan(micro_batch=B, seq=S)))
    per_rank = op_flops(build(tiny_llama, Plan(cp=2, micro_batch=B, seq=S)))
    forward_backward = {n: f for n, f in one.items() if not n.endswith(".adamw")}
    for name, flops in forward_backward.items():
        assert 2 * per_rank[name] == flops, name
