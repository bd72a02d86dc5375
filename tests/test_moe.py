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
    workload = build(SHARED, Plan(dp=ep, ep=ep, micro_batch=B, global_batch=B * ep, seq=S))
    tokens_per_rank = B * S
    by_hand = 2 * (h * e + k * 3 * h * fe + 3 * h * ns * fe)
    assert moe_forward_flops(workload, "layers.2") == by_hand * tokens_per_rank


def test_flops_over_the_ep_group_equal_one_rank():
    one = build(MOE, Plan(micro_batch=4, global_batch=4, seq=S))
    four = build(MOE, Plan(dp=4, ep=4, micro_batch=1, global_batch=4, seq=S))
    assert 4 * four.programs[0].stats.flops_by_phase["F"] == one.programs[0].stats.flops_by_phase["F"]
    fb = lambda w: sum(v for k, v in w.programs[0].stats.flops_by_phase.items() if k != "S")
    assert 4 * fb(four) == fb(one)


@pytest.mark.parametrize("cf", [1.0, 1.25])
def test_all_to_all_bytes_per_moe_layer(cf):
    """Dispatch and combine, forward and backward: each rank puts in its tokens' k copies,
    padded by the capacity factor: tokens per rank . k . H . 2 bytes . cf."""
    dp, ep = 8, 4
    workload = build(MOE, Plan(dp=dp, ep=ep, micro_batch=B, global_batch=B * dp, seq=S, capacity_factor=cf))
    per_rank = Fraction(B * S * 2 * 64 * 2) * Fraction(str(cf))  # tokens . k . H . bf16 . cf
    found = block_collectives(workload, 2)
    a2a = {(phase, size): n for (phase, kind, size), n in found.items() if kind == "ALL_TO_ALL"}
    assert a2a == {("F", per_rank): 2, ("B", per_rank): 2}


def test_expert_gradients_reduce_over_the_expert_data_parallel_group():
    workload = build(MOE, Plan(dp=4, ep=2, micro_batch=B, global_batch=4 * B, seq=S))
    for op in workload.sharded.graph.ops:
        if op.kind is OpKind.COLLECTIVE and op.phase.value == "S":
            expert = ".experts." in op.name
            assert op.attrs["axes"] == (("dp",) if expert else ("dp", "ep")), op.name


def test_dp4_ep4_tp2_pp2_validates(tmp_path):
    model = dict(MOE, layers=2)
    out = tmp_path / "set"
    generate(model, Plan(dp=16, ep=4, tp=2, pp=2, micro_batch=1, global_batch=32, seq=16), out, workers=2)
    assert validate(out) == []


def test_ep_must_divide_the_experts():
    from stg.errors import LayoutError

    with pytest.raises(LayoutError, match="ep=3 does not divide expert dimension E=8"):
        build(MOE, Plan(dp=3, ep=3, global_batch=3, seq=S))


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
    plan = dict(dp=4, ep=4, micro_batch=B, seq=S)
    balanced = build(MOE, Plan(**plan))
    skewed = build(MOE, Plan(**plan, expert_skew=1.0))
    assert skewed.variant_axes == ("ep",) and len(skewed.programs) == 4
    base = expert_gemm_flops(balanced.programs[0])
    for slot, program in enumerate(skewed.programs):
        assert abs(expert_gemm_flops(program) - loads[slot] * base) <= 6  # 2 layers x 3 GEMMs, each rounds up
        assert program.stats.comm_bytes == balanced.programs[0].stats.comm_bytes
    assert [skewed.class_of(rank) for rank in range(4)] == [0, 1, 2, 3]
    out = tmp_path / "set"
    generate(MOE, Plan(**{**plan, "dp": 8}, expert_skew=1.0), out)
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


def fb_total(workload) -> int:
    return workload.summary()["totals"]["flops_forward_backward"]


def test_dp_counts_every_data_parallel_rank():
    """Megatron-Core's meaning: dp=4 with ep=4 is 4 ranks (world = tp*cp*pp*dp), each on a
    quarter of the batch, whose forward+backward FLOPs add up to one rank's on the whole batch
    (capacity factor 1: every expert slot filled, as on one rank)."""
    four = build(MOE, Plan(dp=4, ep=4, micro_batch=1, global_batch=4, seq=S))
    one = build(MOE, Plan(micro_batch=4, global_batch=4, seq=S))
    assert four.mesh.size == 4 and four.mesh.sizes["ep"] == 4 and four.mesh.sizes["dp"] == 1
    assert four.summary()["expert_data_parallel"] == 1
    assert build(MOE, Plan(dp=8, ep=4, micro_batch=1, global_batch=8, seq=S)).summary()["expert_data_parallel"] == 2
    assert fb_total(four) == fb_total(one)
    assert four.programs[0].stats.comm_count["ALL_TO_ALL"] > 0


def test_rank_order_and_groups_follow_megatron_core():
    """Megatron-Core, order tp-cp-ep-dp-pp with tp=2, dp=4, ep=2: dense data-parallel groups are
    the ranks with one tp coordinate, [0, 2, 4, 6] and [1, 3, 5, 7]; expert-parallel groups
    are ep neighbours at stride tp, [0, 2], [4, 6], ...; expert-data-parallel groups
    [0, 4], [2, 6], ..."""
    mesh = Plan(tp=2, dp=4, ep=2, global_batch=4).mesh()
    assert mesh.size == 8
    assert list(mesh.groups(("dp", "ep"))) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert list(mesh.groups(("ep",))) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert list(mesh.groups(("dp",))) == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_ep_must_divide_dp():
    from stg.errors import PlanError

    with pytest.raises(PlanError, match=r"ep=4: must divide dp=2; .* is dp=8"):
        Plan(dp=2, ep=4)


def test_old_plan_files_giving_dp_and_ep_are_refused_with_the_conversion(tmp_path):
    from stg.errors import PlanError

    old = tmp_path / "old.yaml"
    old.write_text("dp: 4\nep: 4\nglobal_batch: 16\n")
    with pytest.raises(PlanError, match=r"write dp: 16; then add plan_version: 2"):
        Plan.from_yaml(old)
    new = tmp_path / "new.yaml"
    new.write_text("plan_version: 2\ndp: 16\nep: 4\nglobal_batch: 16\n")
    assert Plan.from_yaml(new).world_size == 16
    (tmp_path / "dense.yaml").write_text("dp: 4\n")  # no ep: nothing changed
    assert Plan.from_yaml(tmp_path / "dense.yaml").world_size == 4


# -- expert tensor parallelism (etp = tp) -------------------------------------------------------
ETP_PLAN = dict(tp=2, ep=4, dp=4, micro_batch=1, global_batch=4, seq=S)


def test_etp_conserves_flops_and_validates(tmp_path):
    """tp=2 x dp=4 = 8 ranks on 4 sequences do the work of one rank on all 4 (within 1 %: the
    tp ranks repeat the router and the combine of their gathered tokens)."""
    one = fb_total(build(MOE, Plan(micro_batch=4, global_batch=4, seq=S)))
    out = tmp_path / "set"
    summary = generate(MOE, Plan(**ETP_PLAN, etp=2), out, workers=1)
    assert summary["world_size"] == 8
    assert abs(summary["totals"]["flops_forward_backward"] / one - 1) < 0.01
    assert validate(out) == []


def test_etp_splits_each_expert_over_tp():
    """Expert weights per rank: 3 matrices of H x Fe for each of E/ep experts, Fe split over
    etp, bf16; the rest of the model's weights unchanged."""
    expert_bytes = 2 * 3 * (8 // 4) * 64 * 96 * 2  # 2 layers
    weights = {etp: build(MOE, Plan(**ETP_PLAN, etp=etp)).memory[0].weights for etp in (1, 2)}
    assert weights[1] - weights[2] == expert_bytes // 2


def test_etp_collectives_follow_megatron_cores_alltoall_dispatcher():
    """Per MoE layer forward, on each rank (B.S/tp tokens under sequence parallelism, k = 2
    copies, H = 64, bf16): the dispatch all-to-all over ep, an all-gather of the received
    tokens over tp (the experts' column split needs them whole), the experts' partial sums
    reduce-scattered over tp, the combine all-to-all over ep (Megatron-Core's
    MoEAlltoAllTokenDispatcher with etp > 1). Expert gradients no longer reduce over tp."""
    from stg.lower import Evaluator

    workload = build(MOE, Plan(**ETP_PLAN, etp=2))
    evaluate = Evaluator(workload.bindings)
    per_rank = 1 * S // 2 * 2 * 64 * 2
    def expert_collectives(phases):
        return [(op.attrs["collective"].name, op.attrs["axes"], evaluate(op.bytes)) for op in workload.sharded.graph.ops
                if op.kind is OpKind.COLLECTIVE and op.phase.value in phases and op.name.startswith("layers.1.experts.")]

    one_way = [("ALL_TO_ALL", ("ep",), per_rank), ("ALL_GATHER", ("tp",), per_rank),
               ("REDUCE_SCATTER", ("tp",), 2 * per_rank), ("ALL_TO_ALL", ("ep",), per_rank)]
    assert expert_collectives("F") == one_way
    # the backward mirrors it; the tokens the experts received are kept for their weight
    # gradients (as Megatron-Core's grouped GEMM keeps them), not fetched again
    assert expert_collectives("BW") == one_way
    step = [op for op in workload.sharded.graph.ops
            if op.kind is OpKind.COLLECTIVE and op.phase.value == "S" and ".experts." in op.name]
    assert step == []  # dp = ep: no expert-data-parallel replicas, and nothing over tp


def test_etp_must_be_one_or_tp():
    from stg.errors import PlanError

    with pytest.raises(PlanError, match="etp=4: must be 1 or tp=2"):
        Plan(tp=2, etp=4)


def test_etp_expert_gradients_reduce_over_the_expert_data_parallel_group_only():
    """tp=2, dp=4, ep=2: 2 expert-data-parallel replicas (mesh dp). With etp=1 each tp rank
    holds whole experts and its own tokens' gradient: reduced over dp and tp; with etp=tp the
    tp ranks hold different halves: reduced over dp alone."""
    def axes(etp):
        workload = build(MOE, Plan(tp=2, dp=4, ep=2, etp=etp, micro_batch=1, global_batch=4, seq=S))
        return {op.attrs["axes"] for op in workload.sharded.graph.ops
                if op.kind is OpKind.COLLECTIVE and op.phase.value == "S" and ".experts." in op.name}

    assert axes(1) == {("dp", "tp")}
    assert axes(2) == {("dp",)}
