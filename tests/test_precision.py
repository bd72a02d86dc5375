"""Precision: the model's dtype (weights, activations, their communication), mixed-precision
bookkeeping and per-dtype device peaks. Hand counts throughout."""

import pytest

from stg import Plan, build, generate
from stg.chakra.validate import validate
from stg.errors import PlanError

# the Llama-like model of issue 15: 4 layers, dim 256, ffn 1024, 4 heads, 2 KV heads, vocab 1000
LLAMA = dict(name="llama-256", family="llama", layers=4, hidden=256, ffn=1024, heads=4, kv_heads=2, vocab=1000)
# by hand: per block two norms (256 each), q and o (256x256), k and v (256 x 2 heads x 64),
# gate, up, down (256x1024); plus the embedding and the untied output layer (1000x256) and
# the final norm
PARAMS = 4 * (2 * 256 + 2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 1024) + 2 * 1000 * 256 + 256


def test_hand_count_is_the_models():
    assert build(LLAMA, Plan(seq=16)).model.params == PARAMS == 4_446_464


@pytest.mark.parametrize("dtype, nbytes", [("fp32", 4), ("bf16", 2), ("fp16", 2)])
def test_ddp_all_reduces_every_gradient_once_in_the_models_dtype(dtype, nbytes):
    """DDP on 4 ranks: one all-reduce of every gradient per step; ASTRA-sim's comm_size of an
    all-reduce is the whole buffer, so the bytes per rank are the parameter count x dtype."""
    stats = build(LLAMA, Plan(dp=4, dtype=dtype, seq=16)).programs[0].stats
    assert stats.comm_bytes["ALL_REDUCE"] == nbytes * PARAMS
    assert set(stats.comm_bytes) == {"ALL_REDUCE"}


@pytest.mark.parametrize("dtype, weights, grads, states", [
    ("bf16", 2, 2, 12),  # fp32 master copy + two fp32 moments (Micikevicius et al. 2018; ZeRO's K = 12)
    ("fp16", 2, 2, 12),
    ("fp32", 4, 4, 8),   # an fp32 weight is its own master copy: two moments only
])
def test_model_states_are_16_bytes_per_parameter_with_adamw(dtype, weights, grads, states):
    memory = build(LLAMA, Plan(dtype=dtype, seq=16)).memory[0]
    assert (memory.weights, memory.gradients, memory.optimizer_states) == (
        weights * PARAMS, grads * PARAMS, states * PARAMS)
    assert memory.weights + memory.gradients + memory.optimizer_states == 16 * PARAMS


def test_a_model_yaml_may_state_its_dtype_and_the_plan_overrides_it():
    fp32_model = dict(LLAMA, dtype="fp32")
    assert build(fp32_model, Plan(seq=16)).memory[0].weights == 4 * PARAMS
    assert build(fp32_model, Plan(seq=16, dtype="bf16")).memory[0].weights == 2 * PARAMS


# A GEMM beyond the largest in OpenXLA's measured sm_90 table (4096^3, 783.3 of 989.4 TFLOP/s
# in bf16) runs at that fraction of its dtype's peak (stg/data/devices/h100.yaml)
LARGE_GEMM = 0.7917


def test_fp32_gemms_run_at_the_tf32_peak():
    """H100 SXM: 989.4 dense bf16 TFLOP/s, 494.7 TF32. A GEMM large enough to be compute-bound
    takes twice as long in fp32 (same FLOPs)."""
    model = dict(LLAMA, hidden=2048, ffn=8192, heads=16, kv_heads=16, layers=1)

    def gemm(dtype):
        node = next(n for n in build(model, Plan(dtype=dtype, seq=2048, micro_batch=4)).programs[0].nodes
                    if n.name == "0F0 layers.0.mlp.up")
        return node.flops, node.duration_us

    (f16, d16), (f32, d32) = gemm("bf16"), gemm("fp32")
    assert f16 == f32 == 2 * 4 * 2048 * 2048 * 8192
    # whole microseconds, the rounding carried along the chain (tests/test_trace_format.py)
    assert d16 == pytest.approx(f16 / (989.4e6 * LARGE_GEMM), abs=1)
    assert d32 == pytest.approx(f32 / (494.7e6 * LARGE_GEMM), abs=1)


def test_unknown_dtype_is_a_plan_error():
    with pytest.raises(PlanError, match=r"dtype: must be one of \['bf16', 'fp16', 'fp32'\], got 'fp64'"):
        Plan(dtype="fp64")


def test_fp32_set_validates(tmp_path):
    out = tmp_path / "set"
    generate(dict(LLAMA, layers=2), Plan(dp=2, tp=2, dtype="fp32", seq=16, global_batch=4), out, workers=1)
    assert validate(out) == []


# -- fp8 (Transformer Engine's recipe) ---------------------------------------------------------
SMALL = dict(name="l", family="llama", layers=2, hidden=64, ffn=176, heads=8, kv_heads=4, vocab=1000)
S, B = 32, 2


def test_fp8_keeps_the_linear_inputs_in_one_byte():
    """Saved per Llama block (tests/test_memory.py's hand count) with fp8 linears: the inputs
    of q/k/v (the attention norm's output), of the output projection (the attention context),
    of gate/up (the MLP norm's output) and of down (the SwiGLU product) are kept as their fp8
    copies, one byte per element; rotated q, k, v, the residuals and the SwiGLU inputs (16-bit
    GEMM outputs) stay two bytes."""
    h, f, r = 64, 176, 4 / 8
    bf16 = S * B * h * (2 + 2 + 4 * r + 2 + 2 + 2 + 2) + 3 * 2 * S * B * f
    fp8 = S * B * h * (1 + 2 + 4 * r + 1 + 2 + 1 + 2) + S * B * f * (2 + 2 + 1)
    plan = dict(seq=S, micro_batch=B)
    assert build(SMALL, Plan(**plan)).memory[0].activations_by_layer[1] == bf16
    assert build(SMALL, Plan(**plan, fp8=True)).memory[0].activations_by_layer[1] == fp8


def test_fp8_weights_keep_their_16_bit_copy_and_add_an_fp8_one():
    """One byte more per parameter of the blocks' linear layers: q and o 64x64, k and v
    64x32, gate, up and down 64x176, in 2 blocks."""
    linear = 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 176)
    plan = dict(seq=S, micro_batch=B)
    workload = build(SMALL, Plan(**plan, fp8=True))
    assert workload.memory[0].weights - build(SMALL, Plan(**plan)).memory[0].weights == linear
    casts = [n for n in workload.programs[0].nodes if n.name.startswith("S ") and n.name.endswith(".next.fp8")]
    assert len(casts) == 2 * 7  # once per step per linear weight


def test_fp8_halves_the_linear_gemms_on_h100():
    """H100 SXM: 1978.9 dense fp8 TFLOP/s, 989.4 bf16: the forward GEMM and both backward GEMMs
    of a compute-bound linear layer take half as long, with the same FLOPs."""
    model = dict(SMALL, hidden=2048, ffn=8192, heads=16, kv_heads=16, layers=1)
    names = ("0F0 layers.0.mlp.up", "0B0 layers.0.mlp_norm.fp8.grad/1", "0B0 layers.0.mlp.up.weight.grad")
    base = ("0F0 layers.0.mlp.up", "0B0 layers.0.mlp_norm.grad/1", "0B0 layers.0.mlp.up.weight.grad")

    def gemms(fp8, wanted):
        nodes = {n.name: n for n in build(model, Plan(fp8=fp8, seq=2048, micro_batch=4)).programs[0].nodes}
        return [(nodes[name].flops, nodes[name].duration_us) for name in wanted]

    flops = 2 * 4 * 2048 * 2048 * 8192
    for (f16, d16), (f8, d8) in zip(gemms(False, base), gemms(True, names)):
        assert f16 == f8 == flops
        # whole microseconds, the rounding carried along the chain (tests/test_trace_format.py)
        assert d16 == pytest.approx(flops / (989.4e6 * LARGE_GEMM), abs=1)
        assert d8 == pytest.approx(flops / (1978.9e6 * LARGE_GEMM), abs=1)


def test_fp8_sequence_parallel_gathers_the_fp8_copies():
    """Under sequence parallelism the inputs of the column-parallel layers are all-gathered
    as their fp8 copies: B.S.H/tp bytes per rank instead of 2 B.S.H/tp."""
    from helpers import block_collectives

    def gathers(fp8):
        found = block_collectives(build(SMALL, Plan(tp=2, fp8=fp8, seq=S, micro_batch=B)), 1)
        return sorted(size for (phase, kind, size), n in found.items() if phase == "F" and kind == "ALL_GATHER"
                      for _ in range(n))

    assert gathers(False) == [B * S * 64 * 2 // 2] * 2
    assert gathers(True) == [B * S * 64 // 2] * 2


def test_fp8_needs_an_fp8_device():
    with pytest.raises(PlanError, match="fp8: device a100 has no fp8 tensor cores"):
        Plan(fp8=True, device="a100")


def test_fp8_set_validates(tmp_path):
    out = tmp_path / "set"
    generate(SMALL, Plan(dp=2, tp=2, pp=2, zero=1, fp8=True, seq=S, global_batch=4), out, workers=1)
    assert validate(out) == []


def test_fp8_param_gather_keeps_and_gathers_the_fp8_weights_only():
    """ZeRO-1 on dp=4: the blocks' linear weights (92,160 parameters, above) are stored as one
    byte instead of two plus the fp8 copy, and the new parameters are all-gathered in fp8:
    a rank's gathered shard shrinks by 92,160 / 4 bytes. Gradients (bf16) and the fp32 master
    copy and moments are unchanged."""
    linear = 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 176)
    plan = dict(dp=4, zero=1, seq=S, micro_batch=B, fp8=True)
    copy, own = build(SMALL, Plan(**plan)), build(SMALL, Plan(**plan, fp8_param_gather=True))
    assert copy.memory[0].weights - own.memory[0].weights == 2 * linear
    assert (copy.memory[0].gradients, copy.memory[0].optimizer_states) == (
        own.memory[0].gradients, own.memory[0].optimizer_states)
    gathered = [w.programs[0].stats.comm_bytes["ALL_GATHER"] for w in (copy, own)]
    assert gathered[0] - gathered[1] == linear // 4
    assert copy.programs[0].stats.comm_bytes["REDUCE_SCATTER"] == own.programs[0].stats.comm_bytes["REDUCE_SCATTER"]


def test_fp8_param_gather_needs_fp8_and_a_sharded_optimizer():
    with pytest.raises(PlanError, match="fp8_param_gather: .* needs fp8 and zero >= 1"):
        Plan(fp8=True, fp8_param_gather=True)


def test_fp8_param_gather_fsdp_set_validates(tmp_path):
    out = tmp_path / "set"
    generate(SMALL, Plan(dp=4, zero=3, fp8=True, fp8_param_gather=True, seq=S, global_batch=4), out, workers=1)
    assert validate(out) == []
