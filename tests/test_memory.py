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


LLAMA = dict(name="four-blocks", family="llama", layers=4, hidden=64, ffn=176, heads=8, kv_heads=4, vocab=1000)


def _uncached(monkeypatch) -> None:
    """No structure's passes are known (so build may refuse a plan before them)."""
    import stg.passes

    for cache in ("_CACHE", "_HELD"):
        monkeypatch.setattr(stg.passes, cache, {})


def test_a_plan_over_the_limit_by_its_weights_and_optimizer_states_alone_is_refused_before_its_passes(monkeypatch):
    """One stage of pp holds at least an even share of the weights and optimizer states. Hand
    count: the four-block llama has 312,896 parameters (embedding and output layer 2 x 1,000 x
    64; a block 64 x 64 for q and o, 64 x 32 for k and v, 3 x 64 x 176 for the MLP, 2 x 64 of
    norms; a final norm of 64); bf16 weights take 2 bytes and Adam's fp32 master weight and two
    moments 12, halved by ZeRO-1 over dp=2: 8 bytes a parameter, 1,251,584 bytes a stage of
    pp=2. A plan over a limit below that is refused without its structure's passes; at that
    limit the passes run and its exact peak refuses it."""
    import stg.api
    from stg.api import MemoryLimitError

    plan = Plan(pp=2, dp=2, zero=1, global_batch=8, seq=32)
    share = 312_896 * (2 + 12 // 2) // 2
    peak = max(m.peak for m in build(LLAMA, plan).memory)
    assert share < peak
    _uncached(monkeypatch)
    monkeypatch.setattr(stg.api, "symbolic_passes", lambda structure: pytest.fail("the passes ran"))
    with pytest.raises(MemoryLimitError, match="peak at least") as refused:
        build(LLAMA, plan, memory_limit=share - 1)
    assert refused.value.peak == share
    monkeypatch.undo()
    with pytest.raises(MemoryLimitError, match=r"peak \d") as refused:
        build(LLAMA, plan, memory_limit=share)
    assert refused.value.peak == peak


@pytest.mark.parametrize("model, plan", [
    (LLAMA, dict(pp=2, dp=2, zero=0)), (LLAMA, dict(pp=4, dp=2, zero=3)), (LLAMA, dict(tp=2, sp=True, cp=2, zero=2)),
    (LLAMA, dict(pp=2, tp=2, dp=2, zero=1, recompute="full")),
    (dict(name="tiny-moe", family="mixtral", layers=2, hidden=64, ffn=128, heads=4, kv_heads=2, vocab=512, experts=4,
          top_k=2, moe_ffn=96), dict(ep=2, dp=2, zero=1)),
])
def test_the_bound_from_weights_and_optimizer_states_never_refuses_a_plan_at_its_peak(monkeypatch, model, plan):
    """The even share of weights and optimizer states is a lower bound of the peak: a plan
    whose limit is its exact peak is never refused (ZeRO 0-3, tp with sp, cp, pp, full
    recomputation, experts over ep)."""
    plan = Plan(global_batch=8, seq=32, **plan)
    peak = max(m.peak for m in build(model, plan).memory)
    _uncached(monkeypatch)
    build(model, plan, memory_limit=peak, nodes=False)
