"""Serving: the inference step's FLOPs and bytes, the KV cache and its planner, the written sets.

FLOPs are checked against a hand formula of what PyTorch's FlopCounterMode counts on the
HuggingFace model code (torch/utils/flop_counter.py: 2·m·n·k per mm/addmm/bmm; for
scaled_dot_product_attention 2·b·h·s_q·s_kv·d for Q·K^T plus as much for P·V, whole squares),
with sizes from the models' HuggingFace config.json files written out here. HF generate()
applies the LM head to the last position only during prefill (logits_to_keep=1), so the head
covers one position per request per step, as stg's step graph does.
"""

import json
from pathlib import Path

import pytest

from model_zoo import load_model
from stg.chakra.validate import validate
from stg.errors import PlanError, StgError
from stg.plan import AttentionFlops
from stg.serve import ServePlan, generate_serving
from stg.serve.engine import Engine
from stg.serve.kvcache import kv_bytes_per_token_per_layer, plan_kv_cache, pool_blocks
from stg.serve.requests import load_requests
from stg.serve.step import StepShape, uniform

EXAMPLES = str(Path(__file__).resolve().parent.parent / "examples")

# name: (layers, hidden, intermediate, heads, kv_heads, vocab, experts, top_k) from config.json
HF = {
    "llama3-8b": (32, 4096, 14336, 32, 8, 128256, None, None),  # meta-llama/Meta-Llama-3-8B
    "llama2-70b": (80, 8192, 28672, 64, 8, 32000, None, None),  # meta-llama/Llama-2-70b-hf
    "mixtral-8x7b": (32, 4096, 14336, 32, 8, 32000, 8, 2),  # mistralai/Mixtral-8x7B-v0.1
}


TINY = load_model(dict(name="tiny-llama", family="llama", layers=4, hidden=64, ffn=176, heads=8, kv_heads=4,
                       vocab=1000))


def flop_counter_formula(name, tokens, pairs, sampled):
    """FlopCounterMode's count of one HF forward: q/k/v/o projections, the MLP (per routed
    expert: each token through its top-k experts' three matmuls, plus the router), SDPA's two
    batched matmuls over `pairs` query-key pairs, the LM head on `sampled` positions."""
    layers, h, f, heads, kv_heads, vocab, experts, top_k = HF[name]
    d = h // heads
    projections = 2 * tokens * (h * heads * d + 2 * h * kv_heads * d + heads * d * h)
    mlp = 2 * tokens * 3 * h * f if experts is None else 2 * tokens * (top_k * 3 * h * f + h * experts)
    sdpa = 2 * heads * d * pairs + 2 * heads * d * pairs
    return layers * (projections + mlp + sdpa) + 2 * sampled * h * vocab


@pytest.mark.parametrize("name", sorted(HF))
def test_prefill_and_decode_flops_match_flop_counter_formula(name):
    engine = Engine(load_model(name), ServePlan(attention_flops="full"))
    # prefill: batch 1, prompt 1024: 1024 x 1024 pairs (whole square); head on 1 position
    prefill = engine.program(StepShape.of(uniform(1, 1024, 0), AttentionFlops.FULL), 0).stats.to_dict()["flops"]
    expected = flop_counter_formula(name, 1024, 1024 * 1024, 1)
    assert abs(prefill - expected) / expected < 0.01
    # decode: batch 8 at context 1024: each query attends 1024 cached keys and its own
    decode = engine.program(StepShape.of(uniform(8, 1, 1024), AttentionFlops.FULL), 0).stats.to_dict()["flops"]
    expected = flop_counter_formula(name, 8, 8 * 1025, 8)
    assert abs(decode - expected) / expected < 0.01


def test_step_shape_counts_pairs_per_request():
    slots = uniform(2, 3, 5)  # two requests, 3 new tokens on 5 cached
    assert StepShape.of(slots, AttentionFlops.FULL).pairs == 2 * 3 * 8
    assert StepShape.of(slots, AttentionFlops.CAUSAL).pairs == 2 * (3 * 5 + 6)  # 5+6+7+8 = 26 each
    assert StepShape.of(slots, AttentionFlops.CAUSAL).kv_tokens == 16


def test_kv_bytes_per_token():
    assert kv_bytes_per_token_per_layer(load_model("llama3-8b").config) == 2 * 8 * 128 * 2 == 4096
    assert kv_bytes_per_token_per_layer(load_model("llama3-8b").config, "fp8") == 2048
    # DeepSeek-V3 (MLA): kv_lora_rank 512 + qk_rope_head_dim 64, bf16
    assert kv_bytes_per_token_per_layer(load_model("deepseek-v3").config) == (512 + 64) * 2
    # the step graph's cache tensors agree, per rank: 32 layers, KV heads split by tp
    assert Engine(load_model("llama3-8b"), ServePlan()).kv_bytes_per_token(0) == 32 * 4096
    assert Engine(load_model("llama3-8b"), ServePlan(tp=2)).kv_bytes_per_token(0) == 32 * 4096 // 2
    # MLA: the step graph caches the latent and the rotary key, whole on every tp rank
    assert Engine(load_model("deepseek-v3"), ServePlan(tp=8, ep=8)).kv_bytes_per_token(0) == 61 * (512 + 64) * 2


def test_decode_is_memory_bound_reading_weights_and_the_whole_cache():
    engine = Engine(load_model("llama3-8b"), ServePlan())
    shape = StepShape.of(uniform(8, 1, 4096), AttentionFlops.CAUSAL)
    stats = engine.program(shape, 0).stats.to_dict()
    # every weight read once (the embedding table only in the looked-up rows) and every
    # request's whole cache in every layer
    weights = 2 * (8_030_261_248 - 128256 * 4096)
    cache = 8 * 4097 * 32 * 4096
    assert weights + cache < stats["compute_bytes"] < 1.01 * (weights + cache)
    h100 = 3.35e12  # bytes/s; decode's arithmetic intensity is far below 989e12 / 3.35e12 FLOP/byte
    assert stats["flops"] / stats["compute_bytes"] < 10
    durations = sum(n.duration_us for n in engine.program(shape, 0).nodes)
    # the bytes at the HBM bandwidth bound the step from below; decode's small GEMMs (a few
    # tokens against each weight) at their measured fraction of peak add a little
    memory_us = stats["compute_bytes"] / h100 * 1e6
    assert memory_us * 0.99 < durations < memory_us * 1.05


def test_pool_formula_with_hand_numbers():
    # (80 GiB x 0.9 - 16 GB weights - 0.5 GB reserve) / (16 tokens x 131,072 B)
    assert pool_blocks(80 * 2**30, 0.9, 16_000_000_000, 500_000_000, 16, 131_072) == (
        (77_309_411_328 - 16_000_000_000 - 500_000_000) // 2_097_152) == 28_996
    assert 28_996 * 2_097_152 <= 60_809_411_328 < 28_997 * 2_097_152


def test_planner_for_llama3_8b_on_h100():
    engine = Engine(load_model("llama3-8b"), ServePlan())
    kv = plan_kv_cache(engine)
    # parameters: embedding and head 2 x 128256 x 4096, per layer q,o 2 x 4096^2, k,v 2 x 4096 x 1024,
    # MLP 3 x 4096 x 14336, two norms 2 x 4096; final norm 4096 -- bf16
    params = 2 * 128256 * 4096 + 32 * (2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096) + 4096
    assert params == 8_030_261_248
    weights = 2 * params
    # reserve for a 512-token step: the residual stream (512 x 4096 bf16) plus the largest op's
    # activations, sampling's softmax over min(512, 256) = 256 rows of 128,256 logits, in and out
    reserve = 512 * 4096 * 2 + 2 * 256 * 128256 * 2
    stage = kv.per_stage[0]
    assert (stage["weight_bytes"], stage["activation_reserve_bytes"]) == (weights, reserve)
    assert kv.blocks == (int(80 * 2**30 * 0.9) - weights - reserve) // (16 * 32 * 4096)
    assert kv.tokens == kv.blocks * 16
    assert plan_kv_cache(Engine(load_model("llama3-8b"), ServePlan(num_kv_blocks=100))).blocks == 100


def test_planner_refuses_a_model_that_does_not_fit():
    with pytest.raises(PlanError, match="gpu_memory_utilization"):
        plan_kv_cache(Engine(load_model("llama2-70b"), ServePlan()))


@pytest.mark.parametrize("mode, plan, extra", [
    ("prefill", dict(tp=2, pp=2), dict(batch=2, prompt=64)),
    ("decode", dict(tp=2, dp=2), dict(batch=4, context=100, steps=3)),
    ("serve", dict(tp=2, pp=2, dp=2, max_num_batched_tokens=64), dict(requests=EXAMPLES + "/requests-azure.csv")),
    ("serve", dict(dp=1, scheduler="vllm", num_kv_blocks=40), dict(requests=EXAMPLES + "/requests-azure.csv")),
    ("serve", dict(tp=2, pp=2, sp=True, max_num_batched_tokens=64), dict(requests=EXAMPLES + "/requests-azure.csv")),
])
def test_sets_validate(tmp_path, mode, plan, extra):
    out = tmp_path / "set"
    summary = generate_serving(TINY, ServePlan(**plan), out, mode=mode, **extra)
    assert validate(out, replay=True) == []
    data = json.loads((out / "summary.json").read_text())
    assert data["mode"] == mode and data["world_size"] == plan.get("tp", 1) * plan.get("pp", 1) * plan.get("dp", 1)
    if mode == "serve":
        rows = [r for replica in summary["replicas"] for r in replica["requests"]]
        assert len(rows) == len(load_requests(EXAMPLES + "/requests-azure.csv"))
        assert all(r["ttft_s"] > 0 and r["e2e_s"] >= r["ttft_s"] for r in rows)
        # every output token is sampled once
        sampled = sum(len([s for s in it["requests"]]) for rep in summary["replicas"] for it in rep["iterations"])
        assert sampled >= sum(r["output"] for r in rows)


def test_tp_all_reduces_per_layer_and_pp_sends_per_iteration(tmp_path):
    summary = generate_serving(TINY, ServePlan(tp=2, pp=2), tmp_path / "s", mode="decode", batch=2, steps=3)
    first, last = summary["rank_classes"]
    layers = TINY.layers // 2
    # per iteration: 2 all-reduces per layer; the first stage also the vocabulary-parallel embedding's
    assert first["comm_count"]["ALL_REDUCE"] == 3 * (2 * layers + 1)
    assert last["comm_count"] == {"ALL_REDUCE": 3 * 2 * layers, "ALL_GATHER": 3}  # + the logits for sampling
    hidden = TINY.config.hidden
    assert first["send_bytes"] == last["recv_bytes"] == 3 * 2 * hidden * 2  # 2 tokens x hidden bf16, per step


def test_requests_both_schemas(tmp_path):
    azure = load_requests(EXAMPLES + "/requests-azure.csv")
    assert azure[0].arrival_s == 0 and all(a.arrival_s <= b.arrival_s for a, b in zip(azure, azure[1:]))
    mooncake = tmp_path / "m.jsonl"
    mooncake.write_text('{"timestamp": 500, "input_length": 10, "output_length": 3}\n'
                        '{"timestamp": 0, "input_length": 7, "output_length": 2}\n')
    loaded = load_requests(mooncake)
    assert [(r.arrival_s, r.prompt, r.output) for r in loaded] == [(0.0, 7, 2), (0.5, 10, 3)]
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": -1, "output_length": 3}\n')
    with pytest.raises(PlanError, match="input_length must be a positive integer"):
        load_requests(bad)


def test_bad_input_is_one_line_and_writes_nothing(tmp_path):
    for plan, kwargs, field in [(dict(tp=3), {}, "tp=3 does not divide"), ({}, dict(mode="x"), "mode:"),
                                (dict(kv_cache_dtype="int4"), {}, "kv_cache_dtype"),
                                ({}, dict(mode="serve"), "requests:"),
                                (dict(prefill_instances=1), {}, "needs both"),
                                (dict(prefill_instances=1, decode_instances=1), {}, "mode serve")]:
        with pytest.raises(StgError, match=field):
            generate_serving(TINY, ServePlan(**plan), tmp_path / "o", **{"mode": "prefill", **kwargs})
    assert not (tmp_path / "o").exists()


def test_streamed_records_decode_with_the_stock_protobuf_runtime(tmp_path):
    """Fixed-width varints (ids, deps, numbers) read back as the values: ids are positions,
    deps point back, iteration 1 follows iteration 0, tags are unique per message."""
    from stg.chakra import et_def_pb2 as pb
    from stg.chakra.reader import read_trace

    out = tmp_path / "s"
    generate_serving(TINY, ServePlan(tp=2, pp=2), out, mode="decode", batch=2, steps=3)
    kinds = {"is_cpu_op": "bool_val", "num_ops": "int64_val", "tensor_size": "uint64_val", "op_type": "string_val",
             "comm_type": "int64_val", "comm_size": "int64_val", "pg_name": "string_val", "comm_src": "int32_val",
             "comm_dst": "int32_val", "comm_tag": "int32_val"}
    summary = json.loads((out / "summary.json").read_text())
    for rank in range(4):
        nodes = read_trace(out / f"workload.{rank}.et").nodes
        per_iteration = len(nodes) // 3
        assert len(nodes) == 3 * per_iteration
        tags = []
        for position, node in enumerate(nodes):
            assert node.id == position and all(d < position for d in node.data_deps)
            attrs = {a.name: a for a in node.attr}
            assert {a.name: a.WhichOneof("value") for a in node.attr}.items() <= kinds.items()
            if node.type == pb.COMP_NODE:
                assert attrs["num_ops"].int64_val > 0 and attrs["tensor_size"].uint64_val > 0
            elif node.type == pb.COMM_SEND_NODE:
                tags.append(attrs["comm_tag"].int32_val)
        assert len(tags) == len(set(tags))
        assert any(d < per_iteration for d in nodes[per_iteration].data_deps)  # iteration 1 follows 0
        cls = summary["rank_classes"][summary["rank_class"][rank]]
        flops = sum({a.name: a for a in n.attr}["num_ops"].int64_val for n in nodes if n.type == pb.COMP_NODE)
        assert flops >= cls["flops"]  # (written values are at least 1)


def test_disaggregated_prefill_decode_moves_each_kv_cache_once(tmp_path):
    from stg.chakra import et_def_pb2 as pb
    from stg.chakra.reader import read_trace

    out = tmp_path / "d"
    plan = ServePlan(tp=2, pp=2, prefill_instances=1, decode_instances=2, max_num_batched_tokens=64)
    summary = generate_serving(TINY, plan, out, mode="serve", requests=EXAMPLES + "/requests-azure.csv")
    assert validate(out, replay=True) == []
    requests = load_requests(EXAMPLES + "/requests-azure.csv")
    moved = [r for r in requests if r.output > 1]
    assert sorted(t["request"] for t in summary["kv_transfers"]) == [r.id for r in moved]
    # each instance a block of tp x pp = 4 ranks: rank = instance * 4 + stage * 2 + tp; decode
    # instance k gets ids with id % 2 == k - 1
    per_token_per_layer = 2 * (4 // 2) * (64 // 8) * 2  # K and V, 2 of 4 KV heads, head_dim 8, bf16
    for instance in (1, 2):
        for stage in (0, 1):
            rank = instance * 4 + stage * 2 + 1
            nodes = read_trace(out / f"workload.{rank}.et").nodes
            kv = [n for n in nodes if n.type == pb.COMM_RECV_NODE and n.name.startswith("kv ")]
            size = sum({a.name: a for a in n.attr}["comm_size"].int64_val for n in kv)
            mine = [r for r in moved if r.id % 2 == instance - 1]
            assert len(kv) == 2 * len(mine)  # one pair per layer, 2 layers a stage
            assert size == sum(r.prompt for r in mine) * per_token_per_layer * 2
    rows = {r["request"]: r for r in summary["requests"]}
    assert all(rows[r.id]["e2e_s"] > rows[r.id]["ttft_s"] > 0 for r in moved)


def test_speculative_decoding_runs_draft_steps_then_a_verification(tmp_path):
    draft = dict(name="tiny-draft", family="llama", layers=1, hidden=32, ffn=64, heads=4, kv_heads=2, vocab=1000)
    out = tmp_path / "spec"
    plan = ServePlan(tp=2, speculative=3, draft=draft, acceptance_rate=0.5)
    summary = generate_serving(TINY, plan, out, mode="serve", requests=EXAMPLES + "/requests-azure.csv")
    assert validate(out, replay=True) == []
    iterations = summary["replicas"][0]["iterations"]
    verifying = [it for it in iterations if it["draft_steps"] == 3]
    assert verifying
    # a verification runs q = 4 tokens per decode and the LM head on all 4 positions
    decode_only = next(it for it in verifying if all(q == 4 for _, q, _ in it["requests"]))
    assert decode_only["sampled"] == decode_only["tokens"] == 4 * len(decode_only["requests"])
    # every request gets all its tokens: 15/8 per verification, so fewer iterations than tokens
    requests = load_requests(EXAMPLES + "/requests-azure.csv")
    assert len(summary["replicas"][0]["requests"]) == len(requests)
    assert len(iterations) < sum(r.output for r in requests)


@pytest.mark.parametrize("pp", [1, 2])
def test_clock_agrees_with_a_timed_replay_of_the_written_set(tmp_path, pp):
    """The scheduler's clock and `stg validate --timed alpha-beta` of the set it wrote see the
    same iterations take the same time (to the trace's whole-microsecond rounding): the next
    step waits for the sampled tokens, so stages run one after another in both."""
    from stg.chakra.validate import timed_replay

    out = tmp_path / "t"
    summary = generate_serving("llama3-8b", ServePlan(tp=2, pp=pp), out, mode="decode", batch=8, context=512,
                               steps=3)
    replay = timed_replay(out, comm="alpha-beta")
    assert replay.makespan_us == pytest.approx(summary["replicas"][0]["makespan_s"] * 1e6, abs=3)


TINY_MOE = dict(name="tiny-moe", family="mixtral", layers=2, hidden=64, ffn=128, heads=8, kv_heads=4, vocab=1000,
                experts=4, top_k=2, moe_ffn=96)


def test_expert_parallel_engines_dispatch_their_tokens_by_all_to_all(tmp_path):
    # ep 2 engines, each 2 of the 4 requests; per layer and step a dispatch and a combine of
    # each rank's 2 tokens x top-2 x hidden 64 x bf16 = 512 bytes (capacity factor 1)
    out = tmp_path / "ep"
    summary = generate_serving(TINY_MOE, ServePlan(tp=2, ep=2), out, mode="decode", batch=4, context=50, steps=2)
    assert validate(out, replay=True) == []
    stats = summary["rank_classes"][0]
    assert stats["comm_count"]["ALL_TO_ALL"] == 2 * 2 * 2 and stats["comm_bytes"]["ALL_TO_ALL"] == 8 * 2 * 2 * 64 * 2
    # serve: each replica's engines schedule their own requests and step together
    out = tmp_path / "ep-serve"
    summary = generate_serving(TINY_MOE, ServePlan(ep=2, dp=2), out, mode="serve", requests=EXAMPLES + "/requests-azure.csv")
    assert validate(out, replay=True) == []
    it = summary["replicas"][0]["iterations"][0]
    assert len(it["engines"]) == 2
    assert it["tokens"] == max(e["tokens"] for e in it["engines"])  # each engine runs the widest step
    with pytest.raises(PlanError, match="has no experts"):
        generate_serving(TINY, ServePlan(ep=2), tmp_path / "x", mode="prefill", batch=2)


def test_mla_serving_attends_over_the_latent_cache(tmp_path):
    tiny = dict(name="tiny-mla", family="deepseek", layers=2, hidden=64, ffn=128, heads=4, vocab=1000, experts=4,
                top_k=2, moe_ffn=32, shared_experts=1, first_dense_layers=1, q_lora_rank=32, kv_lora_rank=16,
                qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    out = tmp_path / "mla"
    generate_serving(tiny, ServePlan(tp=2, ep=2), out, mode="serve", requests=EXAMPLES + "/requests-azure.csv")
    assert validate(out, replay=True) == []
    engine = Engine(load_model(tiny), ServePlan(tp=2))
    core = next(op for op in engine.sharded.graph.ops if op.name == "layers.0.attn.core")
    shape = StepShape.of(uniform(2, 1, 9), AttentionFlops.FULL)  # 2 decodes, 10 pairs each
    # per pair and local head (4 / tp): scores over latent + rope (16 + 4), context over the latent (16), softmax
    assert engine.evaluator(shape)(core.flops) == 20 * 2 * (2 * 20 + 2 * 16 + 5)


def test_pipeline_keeps_pp_steps_in_flight_in_serve_mode(tmp_path):
    """Two virtual engines under pp 2 (vLLM's): steps alternate between them, a step enters the
    first stage once the step two before has its tokens back, and the timed replay of the
    written set takes as long as the scheduler's clock (a closed batch: no idle time)."""
    from stg.chakra.validate import timed_replay

    closed = tmp_path / "closed.jsonl"
    closed.write_text("".join(json.dumps({"timestamp": 0, "input_length": p, "output_length": o}) + "\n"
                              for p, o in [(300, 12), (80, 30), (500, 5), (120, 20), (60, 9), (250, 16)]))
    out = tmp_path / "pp"
    summary = generate_serving("llama3-8b", ServePlan(tp=2, pp=2), out, mode="serve", requests=closed)
    assert validate(out, replay=True) == []
    iterations = summary["replicas"][0]["iterations"]
    assert [it["virtual_engine"] for it in iterations[:4]] == [0, 1, 0, 1]
    assert iterations[1]["start_s"] < iterations[0]["end_s"]  # in flight together
    replay = timed_replay(out, comm="alpha-beta")
    assert replay.makespan_us == pytest.approx(summary["replicas"][0]["makespan_s"] * 1e6, abs=len(iterations))


def test_sequence_parallel_turns_each_all_reduce_into_reduce_scatter_and_all_gather(tmp_path):
    """Megatron's sequence parallelism: per block the all-reduce of the N-byte activation
    becomes a reduce-scatter (comm_size N, the input) after it and an all-gather (comm_size
    N / tp, each rank's shard) before the next norm. On a ring of n ranks an all-reduce moves
    2 (n - 1) / n N per rank, a reduce-scatter (n - 1) / n N and an all-gather (n - 1) N / n:
    the same traffic, twice the collectives."""
    hidden, layers, tp, tokens = TINY.config.hidden, TINY.layers, 2, 4
    n_bytes = tokens * hidden * 2  # 4 decodes' activations, bf16
    plain = generate_serving(TINY, ServePlan(tp=tp), tmp_path / "ar", mode="decode", batch=tokens, steps=1)
    out = tmp_path / "sp"
    split = generate_serving(TINY, ServePlan(tp=tp, sp=True), out, mode="decode", batch=tokens, steps=1)
    assert validate(out, replay=True) == []
    ar, sp = plain["rank_classes"][0], split["rank_classes"][0]
    # 2 all-reduces a layer, one after the vocabulary-parallel embedding
    assert ar["comm_count"]["ALL_REDUCE"] == 2 * layers + 1 and ar["comm_bytes"]["ALL_REDUCE"] == (2 * layers + 1) * n_bytes
    assert "ALL_REDUCE" not in sp["comm_count"]
    assert sp["comm_count"]["REDUCE_SCATTER"] == 2 * layers + 1
    assert sp["comm_bytes"]["REDUCE_SCATTER"] == (2 * layers + 1) * n_bytes
    # all-gathers: one before each of the 2 norms a layer and the final norm, besides the
    # logits' gather that both sets have (sampled x vocabulary / tp x bf16)
    logits = tokens * (1000 // tp) * 2
    assert ar["comm_count"]["ALL_GATHER"] == 1 and ar["comm_bytes"]["ALL_GATHER"] == logits
    assert sp["comm_count"]["ALL_GATHER"] == 2 * layers + 1 + 1
    assert sp["comm_bytes"]["ALL_GATHER"] == (2 * layers + 1) * n_bytes // tp + logits
    ring = lambda kind, size: {"ALL_REDUCE": 2 * (tp - 1) / tp * size, "REDUCE_SCATTER": (tp - 1) / tp * size,
                               "ALL_GATHER": (tp - 1) * size}[kind]
    per_layer_ar = 2 * ring("ALL_REDUCE", n_bytes)
    per_layer_sp = 2 * ring("REDUCE_SCATTER", n_bytes) + 2 * ring("ALL_GATHER", n_bytes // tp)
    assert per_layer_sp == per_layer_ar
    # 3 tokens are padded to 4 (a multiple of tp): the reduce-scatters carry 4 tokens
    padded = generate_serving(TINY, ServePlan(tp=tp, sp=True), tmp_path / "pad", mode="decode", batch=3, steps=1)
    assert padded["rank_classes"][0]["comm_bytes"]["REDUCE_SCATTER"] == (2 * layers + 1) * n_bytes
    with pytest.raises(PlanError, match="sp: sequence parallelism splits a step's tokens over tp, so it needs tp > 1"):
        ServePlan(sp=True)


DRAFT = dict(name="tiny-draft", family="llama", layers=1, hidden=32, ffn=64, heads=4, kv_heads=2, vocab=1000)


def test_speculative_decoding_under_pp_drafts_on_the_first_stage(tmp_path):
    """The draft runs on the first stage's ranks before the target's step enters it: per
    step, the first stage's all-reduces are the target's 2 a layer for its 2 layers plus the
    embedding's (5), the last stage's 2 a layer (4); each draft step adds the draft's 2 for its
    one layer plus its embedding's (3) on the first stage only. The timed replay of the
    written set agrees with the scheduler's clock (a closed batch)."""
    from stg.chakra.validate import timed_replay

    closed = tmp_path / "closed.jsonl"
    closed.write_text("".join(json.dumps({"timestamp": 0, "input_length": p, "output_length": o}) + "\n"
                              for p, o in [(90, 12), (40, 30), (120, 5), (60, 20)]))
    out = tmp_path / "spec-pp"
    plan = ServePlan(tp=2, pp=2, speculative=3, draft=DRAFT, acceptance_rate=0.5, max_num_batched_tokens=64)
    summary = generate_serving(TINY, plan, out, mode="serve", requests=closed)
    assert validate(out, replay=True) == []
    iterations = summary["replicas"][0]["iterations"]
    steps, drafts = len(iterations), sum(it.get("draft_steps", 0) for it in iterations)
    assert drafts > 0
    first, last = summary["rank_classes"]
    assert first["comm_count"]["ALL_REDUCE"] == 5 * steps + 3 * drafts
    assert last["comm_count"]["ALL_REDUCE"] == 4 * steps
    replay = timed_replay(out, comm="alpha-beta")
    assert replay.makespan_us == pytest.approx(summary["replicas"][0]["makespan_s"] * 1e6, abs=steps + drafts)


def test_speculative_decoding_with_expert_parallel_engines(tmp_path):
    """Each ep engine drafts for its own requests with its own copy of the (dense) draft: the
    draft adds no all-to-all, so each step still has a dispatch and a combine per MoE layer
    (2 layers), and the draft's steps add 3 all-reduces each (tp 2, one layer + embedding)."""
    out = tmp_path / "spec-ep"
    plan = ServePlan(tp=2, ep=2, speculative=2, draft=DRAFT, max_num_batched_tokens=64)
    summary = generate_serving(TINY_MOE, plan, out, mode="serve", requests=EXAMPLES + "/requests-azure.csv")
    assert validate(out, replay=True) == []
    iterations = summary["replicas"][0]["iterations"]
    steps, drafts = len(iterations), sum(it.get("draft_steps", 0) for it in iterations)
    assert drafts > 0
    stats = summary["rank_classes"][0]
    assert stats["comm_count"]["ALL_TO_ALL"] == 2 * 2 * steps
    plain = generate_serving(TINY_MOE, ServePlan(tp=2, ep=2), tmp_path / "d", mode="decode", batch=2, steps=1)
    per_step = plain["rank_classes"][0]["comm_count"]["ALL_REDUCE"]
    assert stats["comm_count"]["ALL_REDUCE"] == per_step * steps + 3 * drafts
