"""Training FLOPs against Narayanan et al., "Efficient Large-Scale Language Model Training on
GPU Clusters Using Megatron-LM" (SC'21), eq. 3: F = 72 B s l h^2 (1 + s/(6h) + V/(12 l h)),
which counts the contractions (GEMMs) of forward and backward, attention as full squares."""

import pytest

from stg import Plan, build

B, S, L, H, V = 1, 2048, 96, 12288, 50257


def narayanan(b, s, l, h, v, attention=1.0):
    # expanded so the test stays in exact integers: 72Bslh^2 + 12Bs^2lh + 6BshV; causal
    # attention computes half of each score matrix, halving the middle term
    return 72 * b * s * l * h * h + int(12 * attention) * b * s * s * l * h + 6 * b * s * h * v


@pytest.fixture(scope="module")
def gpt3_full():
    return build("gpt3-175b", Plan(micro_batch=B, seq=S, attention_flops="full")).summary()["rank_classes"][0]


def test_gpt3_forward_backward_matmul_flops_equal_eq3_exactly(gpt3_full):
    assert gpt3_full["matmul_flops_forward_backward"] == narayanan(B, S, L, H, V)


def test_non_matmul_ops_add_a_fraction_of_a_percent(gpt3_full):
    total = gpt3_full["flops_forward_backward"]
    assert narayanan(B, S, L, H, V) < total < 1.001 * narayanan(B, S, L, H, V)


def test_causal_counting_halves_the_attention_term():
    causal = build("gpt3-175b", Plan(micro_batch=B, seq=S)).summary()["rank_classes"][0]
    assert causal["matmul_flops_forward_backward"] == narayanan(B, S, L, H, V, attention=0.5)


def test_optimizer_flops_are_reported_apart(gpt3_full):
    assert gpt3_full["flops_optimizer"] == 15 * 174_604_259_328
    assert gpt3_full["flops"] == gpt3_full["flops_forward_backward"] + gpt3_full["flops_optimizer"]
