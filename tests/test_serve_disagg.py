"""Disaggregated serving with each kind of instance's own layout: KV caches moved between
different tp/pp splits, expert parallelism on the instances, the rank numbering.

Expected sizes are worked out by hand from the model's sizes (KV heads, head_dim, layers) and
the documented layout (stg/serve/instances.py), never read back from stg's summary."""

import re
from collections import defaultdict
from pathlib import Path

import pytest

from stg.chakra import et_def_pb2 as pb
from stg.chakra.reader import read_trace
from stg.chakra.validate import validate
from stg.errors import PlanError
from stg.serve import ServePlan, generate_serving
from stg.serve.instances import partners
from stg.serve.requests import load_requests

EXAMPLES = str(Path(__file__).resolve().parent.parent / "examples")
AZURE = EXAMPLES + "/requests-azure.csv"
# 4 layers, 4 KV heads of head_dim 64 / 8 = 8: K and V of one head, one token, one layer in
# bf16 = 2 x 8 x 2 = 32 bytes; all 4 heads: 128 bytes per token and layer
TINY = dict(name="tiny-llama", family="llama", layers=4, hidden=64, ffn=176, heads=8, kv_heads=4, vocab=1000)
HEAD_BYTES = 2 * 8 * 2


def kv_messages(out: Path, world: int):
    """Every KV send and recv of the set: (rank, request, layer, peer, bytes), by kind."""
    found = {pb.COMM_SEND_NODE: [], pb.COMM_RECV_NODE: []}
    for rank in range(world):
        for node in read_trace(out / f"workload.{rank}.et").nodes:
            match = re.fullmatch(r"kv r(\d+) layer (\d+)", node.name)
            if match and node.type in found:
                attrs = {a.name: a for a in node.attr}
                peer = attrs["comm_dst" if node.type == pb.COMM_SEND_NODE else "comm_src"].int32_val
                found[node.type].append((rank, int(match[1]), int(match[2]), peer, attrs["comm_size"].int64_val))
    return found[pb.COMM_SEND_NODE], found[pb.COMM_RECV_NODE]


def test_prefill_tp4_to_decode_tp2_pp2_moves_each_head_once(tmp_path):
    out = tmp_path / "d"
    plan = ServePlan(prefill_instances=1, decode_instances=2, prefill_tp=4, prefill_pp=1, decode_tp=2, decode_pp=2,
                     max_num_batched_tokens=64)
    summary = generate_serving(TINY, plan, out, mode="serve", requests=AZURE)
    assert validate(out, replay=True) == []
    # ranks: the prefill instance 0..3 (tp 4), decode instance 1 4..7 and 2 8..11 (tp 2 fastest, then pp 2)
    assert summary["world_size"] == 12
    assert [(i["kind"], i["tp"], i["pp"], i["first_rank"]) for i in summary["instances"]] == [
        ("prefill", 4, 1, 0), ("decode", 2, 2, 4), ("decode", 2, 2, 8)]
    moved = {r.id: r for r in load_requests(AZURE) if r.output > 1}
    sends, recvs = kv_messages(out, 12)
    per_request = defaultdict(int)
    for rank, request, layer, peer, size in sends:
        # prefill rank a holds KV head a (4 heads / tp 4) of every layer; decode rank b of a
        # stage holds heads 2b, 2b + 1 (tp 2), layers 0-1 on stage 0, 2-3 on stage 1: head a
        # goes to tp rank a // 2 of the stage holding the layer, of decode instance 1 + id % 2
        assert rank < 4 and size == moved[request].prompt * 1 * HEAD_BYTES
        assert peer == 4 * (1 + request % 2) + 2 * (layer // 2) + rank // 2
        per_request[request] += size
    # per request: prompt x 4 layers x 128 bytes (every head of every layer, once)
    assert per_request == {rid: r.prompt * 4 * 4 * HEAD_BYTES for rid, r in moved.items()}
    for rank, request, layer, peer, size in recvs:
        assert rank == 4 * (1 + request % 2) + 2 * (layer // 2) + peer // 2
    assert sum(s[-1] for s in sends) == sum(r[-1] for r in recvs) == sum(r.prompt for r in moved.values()) * 4 * 128
    assert len(sends) == len(recvs) == len(moved) * 4 * 4  # per request: 4 layers x 4 heads, one pair each


def test_prefill_tp2_to_decode_tp4_splits_each_rank_cache(tmp_path):
    out = tmp_path / "d"
    plan = ServePlan(prefill_instances=1, decode_instances=1, prefill_tp=2, decode_tp=4, max_num_batched_tokens=64)
    generate_serving(TINY, plan, out, mode="serve", requests=AZURE)
    assert validate(out, replay=True) == []
    moved = {r.id: r for r in load_requests(AZURE) if r.output > 1}
    sends, recvs = kv_messages(out, 6)
    # prefill rank a holds heads 2a, 2a + 1: one send per head, to decode ranks 2 + 2a and 2 + 2a + 1
    for rank, request, layer, peer, size in sends:
        assert peer in (2 + 2 * rank, 3 + 2 * rank) and size == moved[request].prompt * HEAD_BYTES
    assert len(sends) == len(recvs) == len(moved) * 4 * 4
    assert sum(s[-1] for s in sends) == sum(r[-1] for r in recvs) == sum(r.prompt for r in moved.values()) * 4 * 128


def test_uneven_overlaps_give_ranks_their_own_programs(tmp_path):
    # 6 KV heads: prefill tp 2 holds heads 0-2 and 3-5, decode tp 3 holds 0-1, 2-3, 4-5, so
    # prefill rank 0 sends 2 heads to decode rank 0 and 1 to decode rank 1, and so on
    assert partners(0, 2, 3, 6, True) == ((0, 2), (1, 1)) and partners(1, 2, 3, 6, True) == ((1, 1), (2, 2))
    assert partners(1, 3, 2, 6, False) == ((0, 1), (1, 1))
    six = dict(name="tiny-six", family="llama", layers=2, hidden=96, ffn=192, heads=12, kv_heads=6, vocab=1200)
    out = tmp_path / "d"
    plan = ServePlan(prefill_instances=1, decode_instances=1, prefill_tp=2, decode_tp=3, max_num_batched_tokens=64)
    generate_serving(six, plan, out, mode="serve", requests=AZURE)
    assert validate(out, replay=True) == []
    moved = {r.id: r for r in load_requests(AZURE) if r.output > 1}
    sends, recvs = kv_messages(out, 5)
    head = 2 * 8 * 2  # head_dim 96 / 12 = 8, K and V, bf16
    expected = {(0, 2): 2, (0, 3): 1, (1, 3): 1, (1, 4): 2}  # (prefill rank, decode rank): heads
    for rank, request, layer, peer, size in sends:
        assert size == moved[request].prompt * expected[(rank, peer)] * head
    assert sum(s[-1] for s in sends) == sum(r[-1] for r in recvs) == sum(r.prompt for r in moved.values()) * 2 * 6 * head


def test_mla_latent_comes_from_one_prefill_rank_per_decode_rank(tmp_path):
    tiny = dict(name="tiny-mla", family="deepseek", layers=2, hidden=64, ffn=128, heads=4, vocab=1000, experts=4,
                top_k=2, moe_ffn=32, shared_experts=1, first_dense_layers=1, q_lora_rank=32, kv_lora_rank=16,
                qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    out = tmp_path / "d"
    plan = ServePlan(prefill_instances=1, decode_instances=1, prefill_tp=2, decode_tp=4, max_num_batched_tokens=64)
    generate_serving(tiny, plan, out, mode="serve", requests=AZURE)
    assert validate(out, replay=True) == []
    moved = {r.id: r for r in load_requests(AZURE) if r.output > 1}
    sends, _ = kv_messages(out, 6)
    latent = (16 + 4) * 2  # kv_lora_rank + qk_rope_head_dim, bf16, per token and layer
    for rank, request, layer, peer, size in sends:  # decode rank b takes it from prefill rank b mod 2
        assert (peer - 2) % 2 == rank and size == moved[request].prompt * latent
    # every decode rank (4) gets the whole latent of both layers
    assert sum(s[-1] for s in sends) == sum(r.prompt for r in moved.values()) * 2 * latent * 4


def test_expert_parallel_instances(tmp_path):
    moe = dict(name="tiny-moe", family="mixtral", layers=2, hidden=64, ffn=128, heads=8, kv_heads=4, vocab=1000,
               experts=4, top_k=2, moe_ffn=96)
    out = tmp_path / "ep"
    plan = ServePlan(tp=2, ep=2, prefill_instances=1, decode_instances=1, decode_tp=1, max_num_batched_tokens=64)
    summary = generate_serving(moe, plan, out, mode="serve", requests=AZURE)
    assert validate(out, replay=True) == []
    # prefill: tp 2 x ep 2 = ranks 0..3 (engine e, tp a: 2e + a); decode: tp 1 x ep 2 = ranks 4, 5
    assert summary["world_size"] == 6
    moved = {r.id: r for r in load_requests(AZURE) if r.output > 1}
    sends, _ = kv_messages(out, 6)
    per_request = defaultdict(int)
    for rank, request, layer, peer, size in sends:
        assert peer in (4, 5) and size == moved[request].prompt * 2 * HEAD_BYTES  # 2 of the 4 heads
        per_request[request] += size
    assert per_request == {rid: r.prompt * 2 * 4 * HEAD_BYTES for rid, r in moved.items()}
    # both engines of each instance dispatch tokens to their experts
    assert all(c["comm_count"].get("ALL_TO_ALL", 0) > 0 for c in summary["rank_classes"])


@pytest.mark.parametrize("plan, message", [
    (dict(prefill_tp=2), "prefill_tp: applies to disaggregated serving"),
    (dict(prefill_instances=1, decode_instances=1, decode_tp=3), "decode_tp: 3 does not divide model tiny-llama's 4 KV heads"),
    (dict(prefill_instances=1, decode_instances=1, prefill_pp=0), "prefill_pp: must be a positive integer"),
    (dict(prefill_instances=1, decode_instances=1, speculative=2, draft="llama3-8b"),
     "speculative: not with prefill and decode instances"),
])
def test_bad_layouts(tmp_path, plan, message):
    with pytest.raises(PlanError, match=message):
        generate_serving(TINY, ServePlan(**plan), tmp_path / "o", mode="serve", requests=AZURE)
    assert not (tmp_path / "o").exists()


def test_same_input_same_bytes_and_summary_references_the_records(tmp_path):
    import json

    plan = ServePlan(prefill_instances=1, decode_instances=2, prefill_tp=4, decode_tp=2, decode_pp=2,
                     max_num_batched_tokens=64)
    for name in ("a", "b"):
        generate_serving(TINY, plan, tmp_path / name, mode="serve", requests=AZURE)
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "b").iterdir()) and "iterations.jsonl" in files
    assert all((tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes() for f in files)
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    lines = (tmp_path / "a" / "iterations.jsonl").read_text().splitlines()
    first = 0
    for entry in summary["instances"]:
        ref = entry["iterations"]
        assert ref["file"] == summary["iterations_file"] == "iterations.jsonl" and ref["first_line"] == first
        assert all(json.loads(line)["instance"] == entry["instance"] for line in lines[first:first + ref["count"]])
        first += ref["count"]
    assert first == len(lines)


def test_no_communication_of_zero_bytes(tmp_path):
    """A prompt longer than the token budget runs in chunks; a chunk that samples nothing
    gathers no logits. ASTRA-sim hangs on a 0-byte collective (README, ASTRA-sim), so such a
    node carries 4 KiB, as the other serving modes write it (a set of this kind hung there)."""
    out = tmp_path / "d"
    plan = ServePlan(tp=2, prefill_instances=1, decode_instances=1, max_num_batched_tokens=64)
    generate_serving(TINY, plan, out, mode="serve", requests=AZURE)  # prompts of up to 300 tokens
    sizes = [{a.name: a for a in n.attr}["comm_size"].int64_val for rank in range(4)
             for n in read_trace(out / f"workload.{rank}.et").nodes if n.type != pb.COMP_NODE]
    assert min(sizes) > 0 and 4096 in sizes
