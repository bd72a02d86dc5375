"""Megatron tensor parallelism and sequence parallelism, from layouts alone.

Sources: Shoeybi et al. 2019 (Megatron-LM) sec. 3 -- two all-reduces forward and two backward
per layer; Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models") sec. 4.2.2 -- with sequence parallelism, all-gathers and reduce-scatters of the same
volume replace them, plus Megatron's backward re-gather of each column-parallel input."""

import pytest

from helpers import block_collectives, op_flops
from stg import Plan, build
from stg.errors import LayoutError

B, S, H = 2, 32, 64  # micro-batch, sequence, hidden of the tiny models
BSH_BYTES = B * S * H * 2  # bf16 activations


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_gpt"])
def test_without_sp_four_all_reduces_per_layer(family, request):
    model = request.getfixturevalue(family)
    workload = build(model, Plan(tp=2, sp=False, micro_batch=B, seq=S))
    assert block_collectives(workload, 2) == {
        ("F", "ALL_REDUCE", BSH_BYTES): 2,
        ("B", "ALL_REDUCE", BSH_BYTES): 2,
        # weight gradients of the replicated norm (and, for GPT, biases) sync over tp too? no:
        # without sp they are computed whole on every tp rank, so only data parallelism syncs them
    }


@pytest.mark.parametrize("tp", [2, 4])
def test_with_sp_gathers_and_scatters_of_the_same_volume(tiny_llama, tp):
    workload = build(tiny_llama, Plan(tp=tp, micro_batch=B, seq=S))
    found = block_collectives(workload, 2)
    # ALL_GATHER contributes the shard, REDUCE_SCATTER puts in the whole: the same ring volume
    shard, whole = BSH_BYTES // tp, BSH_BYTES
    assert found[("F", "ALL_GATHER", shard)] == 2 and found[("F", "REDUCE_SCATTER", whole)] == 2
    assert found[("B", "ALL_GATHER", shard)] == 2 and found[("B", "REDUCE_SCATTER", whole)] == 2
    # the sequence-split norm outputs gathered again for the column-parallel weight gradients
    assert found[("W", "ALL_GATHER", shard)] == 2
    # norm weights see only their sequence shard: their gradients are partial over tp
    assert {k[1] for k in found if k[0] == "S"} == {"ALL_REDUCE"}
    assert sum(found.values()) == 10 + sum(v for k, v in found.items() if k[0] == "S")


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("family", ["tiny_llama", "tiny_gpt"])
def test_flops_over_the_tp_group_equal_one_rank(family, sp, request):
    """Every op is either split evenly over tp or run whole on every rank; the contractions
    are all split, so their FLOPs over the group equal the tp=1 run exactly."""
    model = request.getfixturevalue(family)
    one = op_flops(build(model, Plan(micro_batch=B, seq=S)))
    tp = 2
    split = build(model, Plan(tp=tp, sp=sp, micro_batch=B, seq=S))
    per_rank = op_flops(split)
    assert tp * split.programs[0].stats.matmul_flops == build(model, Plan(micro_batch=B, seq=S)).programs[0].stats.matmul_flops
    replicated = 0
    for name, flops in one.items():
        assert tp * per_rank[name] in (flops, tp * flops), name
        if tp * per_rank[name] == tp * flops:
            replicated += flops
    assert tp * sum(per_rank.values()) == sum(one.values()) + (tp - 1) * replicated
    if sp:  # sequence parallelism splits the norms and residual adds too
        assert all(tp * per_rank[n] == one[n] for n in one if n.endswith(("_norm", "_residual")))


def test_vocabulary_parallel_loss_reduces_statistics_not_logits(tiny_llama):
    workload = build(tiny_llama, Plan(tp=2, sp=False, micro_batch=B, seq=S))
    head = block_collectives(workload, tiny_llama["layers"] + 1)
    # max, sum of exp and target logit per token, fp32: Megatron's vocab-parallel cross-entropy
    assert head[("F", "ALL_REDUCE", 3 * B * S * 4)] == 1
    vocab_bytes = B * S * tiny_llama["vocab"] * 2
    assert not any(size >= vocab_bytes // 2 for _, _, size in head)
    embed = block_collectives(workload, 0)
    assert embed[("F", "ALL_REDUCE", BSH_BYTES)] == 1  # the vocab-parallel embedding's partial sums


def test_tp_must_divide_the_kv_heads(tiny_llama):
    with pytest.raises(LayoutError, match="tp=8 does not divide kv_heads dimension Akv=4"):
        build(tiny_llama, Plan(tp=8, micro_batch=B, seq=S))


def test_vocabulary_is_padded_for_tensor_parallelism():
    """GPT-3's 50,257-token vocabulary: tp=8 pads it to 50,264 (the next multiple of 8);
    Megatron's --make-vocab-size-divisible-by 128 pads to 51,200 (a multiple of 128 * 8)."""
    from stg.lower import Evaluator

    gpt = dict(name="g", family="gpt", layers=1, hidden=64, ffn=256, heads=8, vocab=50257, max_positions=64)
    for multiple, padded in ((1, 50264), (128, 51200)):
        workload = build(gpt, Plan(tp=8, seq=16, make_vocab_divisible_by=multiple))
        table = workload.sharded.graph.tensors["embed.weight"]
        assert Evaluator(workload.bindings)(table.numel) == padded // 8 * 64
