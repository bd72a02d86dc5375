"""Mixtures of experts and expert parallelism."""

from fractions import Fraction

import pytest

from test_hf_import import deepseek_by_hand

from helpers import block_collectives
from model_zoo import load_model
from stg import Plan, build, generate
from stg.chakra.validate import validate
from stg.graph import OpKind

PUBLISHED = {"mixtral-8x7b": 46_702_792_704, "mixtral-8x22b": 140_630_071_296, "deepseek-v3": 671_026_404_352}
MOE = dict(name="tiny-moe", family="mixtral", layers=2, hidden=64, ffn=128, heads=4, kv_heads=2, vocab=512,
           experts=8, top_k=2, moe_ffn=96)
SHARED = dict(MOE, name="tiny-shared", shared_experts=2, first_dense_layers=1, layers=3)
B, S = 2, 16


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_match_huggingface(name):
    """DeepSeek-V3: the main model, without the multi-token-prediction module and without the
    routers' e_score_correction_bias (58 x 256 values HuggingFace keeps as buffers)."""
    assert load_model(name).params == PUBLISHED[name]


def test_hypothetical_trillion_parameter_models():
    # the zoo files' sizes, counted by test_hf_import's hand formula for DeepSeek-V3's layout
    for name, (h, f, moe_f, experts, q_lora) in {"moe-1t": (7168, 18432, 2304, 384, 1536),
                                                  "moe-2t": (8192, 24576, 2688, 512, 2048)}.items():
        config = {"hidden_size": h, "num_attention_heads": 128, "q_lora_rank": q_lora, "kv_lora_rank": 512,
                  "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "first_k_dense_replace": 3,
                  "num_hidden_layers": 61, "n_routed_experts": experts, "n_shared_experts": 1,
                  "moe_intermediate_size": moe_f, "intermediate_size": f, "vocab_size": 129280}
        assert load_model(name).params == deepseek_by_hand(config), name


def moe_forward_flops(workload, block):
    """The contractions of one MoE block's forward in micro-batch 0: router, experts, shared."""
    gemms = [f"{block}.router.logits"] + [f"{block}.{part}.{w}" for part in ("experts", "shared")
                                           for w in ("gate", "up", "down", "down.matmul")]
    return sum(n.flops for n in workload.programs[0].nodes if n.name.split(" ", 1) in [["0F0", g] for g in gemms])


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_moe_layer_flops_per_token(ep):
    """2 (router GEMM H.E + k experts 3.H.Fe + shared experts 3.H.Ns.Fe) per token, whatever ep."""
    h, e, k, fe, ns = 64, 8, 2, 96, 2
    workload = build(SHARED, Plan(ep=ep, micro_batch=B, global_batch=B * ep, seq=S))
    tokens_per_rank = B * S
    by_hand = 2 * (h * e + k * 3 * h * fe + 3 * h * ns * fe)
    assert moe_forward_flops(workload, "layers.2") == by_hand * tokens_per_rank


def test_flops_over_the_ep_group_equal_one_rank():
    one = build(MOE, Plan(micro_batch=4, global_batch=4, seq=S))
    four = build(MOE, Plan(ep=4, micro_batch=1, global_batch=4, seq=S))
    assert 4 * four.programs[0].stats.flops_by_phase["F"] == one.programs[0].stats.flops_by_phase["F"]
    fb = lambda w: sum(v for k, v in w.programs[0].stats.flops_by_phase.items() if k != "S")
    assert 4 * fb(four) == fb(one)


@pytest.mark.parametrize("cf", [1.0, 1.25])
def test_all_to_all_bytes_per_moe_layer(cf):
    """Dispatch and combine, forward and backward: each rank puts in its tokens' k copies,
    padded by the capacity factor: tokens per rank . k . H . 2 bytes . cf."""
    dp, ep = 2, 4
    workload = build(MOE, Plan(dp=dp, ep=ep, micro_batch=B, global_batch=B * dp * ep, seq=S, capacity_factor=cf))
    per_rank = Fraction(B * S * 2 * 64 * 2) * Fraction(str(cf))  # tokens . k . H . bf16 . cf
    found = block_collectives(workload, 2)
    a2a = {(phase, size): n for (phase, kind, size), n in found.items() if kind == "ALL_TO_ALL"}
    assert a2a == {("F", per_rank): 2, ("B", per_rank): 2}


def test_expert_gradients_reduce_over_the_expert_data_parallel_group():
    workload = build(MOE, Plan(dp=2, ep=2, micro_batch=B, global_batch=4 * B, seq=S))
    for op in workload.sharded.graph.ops:
        if op.kind is OpKind.COLLECTIVE and op.phase.value == "S":
            expert = ".experts." in op.name
            assert op.attrs["axes"] == (("dp",) if expert else ("dp", "ep")), op.name


def test_dp4_ep4_tp2_pp2_validates(tmp_path):
    model = dict(MOE, layers=2)
    out = tmp_path / "set"
    generate(model, Plan(dp=4, ep=4, tp=2, pp=2, micro_batch=1, global_batch=32, seq=16), out, workers=2)
    assert validate(out) == []


def test_ep_must_divide_the_experts():
    from stg.errors import LayoutError

    with pytest.raises(LayoutError, match="ep=3 does not divide expert dimension E=8"):
        build(MOE, Plan(ep=3, global_batch=3, seq=S))


def test_deepseek_mla_splits_heads_over_tp():
    model = dict(name="tiny-ds", family="deepseek", layers=2, hidden=64, ffn=128, heads=4, vocab=512, experts=4,
                 moe_ffn=32, top_k=2, shared_experts=1, first_dense_layers=1, q_lora_rank=32, kv_lora_rank=16,
                 qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    one = build(model, Plan(micro_batch=B, seq=S))
    two = build(model, Plan(tp=2, micro_batch=B, seq=S))
    assert 2 * two.programs[0].stats.matmul_flops == one.programs[0].stats.matmul_flops


def expert_gemm_flops(program):
    return sum(n.flops for n in program.nodes
               if n.name.startswith("0F0 ") and ".experts." in n.name and n.name.endswith((".gate", ".up", ".down")))


def test_routing_skew_makes_expert_compute_uneven(tmp_path):
    """Zipf(s=1) loads over 8 experts, 2 per slot on ep=4: slot r's experts get
    (1/(2r+1) + 1/(2r+2)) / H_8 of the tokens, ep times that relative to balanced routing.
    The all-to-alls stay even (buffers are padded to the capacity)."""
    harmonic = sum(1 / e for e in range(1, 9))
    loads = [4 * (1 / (2 * r + 1) + 1 / (2 * r + 2)) / harmonic for r in range(4)]
    plan = dict(ep=4, micro_batch=B, seq=S)
    balanced = build(MOE, Plan(**plan))
    skewed = build(MOE, Plan(**plan, expert_skew=1.0))
    assert skewed.variant_axes == ("ep",) and len(skewed.programs) == 4
    base = expert_gemm_flops(balanced.programs[0])
    for slot, program in enumerate(skewed.programs):
        assert abs(expert_gemm_flops(program) - loads[slot] * base) <= 6  # 2 layers x 3 GEMMs, each rounds up
        assert program.stats.comm_bytes == balanced.programs[0].stats.comm_bytes
    assert [skewed.class_of(rank) for rank in range(4)] == [0, 1, 2, 3]
    out = tmp_path / "set"
    generate(MOE, Plan(**plan, dp=2, expert_skew=1.0), out)
    assert validate(out) == []


@pytest.mark.parametrize("family", ["mixtral", "deepseek"])
@pytest.mark.parametrize("tp", [2, 4])
def test_experts_under_tp_need_sequence_parallelism(tmp_path, family, tp):
    """Without sp every tp rank holds every token and would route and compute them all (issue
    19 measured +84 % FLOPs at tp 2); Megatron-Core refuses MoE with tp but without sp
    ("When using MoE and tensor parallelism, sequence parallelism must be used")."""
    import yaml
    from typer.testing import CliRunner

    from stg.cli import app

    spec = dict(MOE, kv_heads=4) if family == "mixtral" else dict(
        name="tiny-ds", family="deepseek", layers=2, hidden=64, ffn=128, heads=4, vocab=512, experts=4, moe_ffn=32,
        top_k=2, shared_experts=1, first_dense_layers=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8)
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump(spec))
    result = CliRunner().invoke(app, ["generate", str(path), "--tp", str(tp), "--no-sp", "--global-batch", "2",
                                      "--seq", "32", "-o", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and result.output.startswith("error: sp: ") and "sequence parallelism" in result.output
    assert not (tmp_path / "out").exists()
