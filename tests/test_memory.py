"""Activation memory against Korthikanti et al. 2022 ("Reducing Activation Recomputation in
Large Transformer Models"), Table 2, for a GPT block with 16-bit activations, dropout and
materialised attention (the setting of their count), and a Llama block counted by hand."""

import pytest

from stg import Plan, build

S, B = 32, 2
GPT = dict(name="gpt", family="gpt", layers=3, hidden=64, ffn=256, heads=4, vocab=1000, max_positions=128)
H, A = GPT["hidden"], GPT["heads"]


def block_activations(model, **plan) -> int:
    """Bytes saved for the backward by a middle block, one micro-batch."""
    workload = build(model, Plan(micro_batch=B, seq=S, **plan))
    return workload.memory[0].activations_by_layer[2]


def test_no_parallelism():
    assert block_activations(GPT, flash_attention=False) == S * B * H * (34 + 5 * A * S / H)


@pytest.mark.parametrize("t", [2, 4])
def test_tensor_parallel(t):
    got = block_activations(GPT, tp=t, sp=False, flash_attention=False)
    assert got == S * B * H * (10 + 24 / t + 5 * A * S / (H * t))


@pytest.mark.parametrize("t", [2, 4])
def test_tensor_and_sequence_parallel(t):
    got = block_activations(GPT, tp=t, flash_attention=False)
    assert got == S * B * H / t * (34 + 5 * A * S / H)


@pytest.mark.parametrize("t", [1, 2, 4])
def test_selective_recompute(t):
    got = block_activations(GPT, tp=t, recompute="selective", flash_attention=False)
    assert got == 34 * S * B * H / t


def test_full_recompute():
    assert block_activations(GPT, recompute="full", flash_attention=False) == 2 * S * B * H


def test_llama_block_by_hand(tiny_llama):
    """Saved per Llama block (bf16, fused attention): the attention norm's output (2sbh),
    rotated q (2sbh) and k and v (2sbh each times kv_heads/heads), the attention output
    (2sbh), the residual (2sbh), the MLP norm's output (2sbh), gate, up and their SwiGLU
    product (2sbF each), and the block's output (2sbh). Rotary embedding is linear, so its
    inputs are not kept; fused attention keeps no score matrix."""
    h, f = tiny_llama["hidden"], tiny_llama["ffn"]
    r = tiny_llama["kv_heads"] / tiny_llama["heads"]
    expected = S * B * h * (2 + 2 + 4 * r + 2 + 2 + 2 + 2) + 3 * 2 * S * B * f
    assert block_activations(tiny_llama) == expected


def test_memory_reported_in_summary(tiny_llama):
    summary = build(tiny_llama, Plan(dp=2, zero=1, micro_batch=B, seq=S)).summary()
    memory = summary["rank_classes"][0]["memory"]
    assert set(memory) == {"weights", "gradients", "optimizer_states", "activations", "peak"}
    assert memory["peak"] == memory["weights"] + memory["gradients"] + memory["optimizer_states"] + memory["activations"]
