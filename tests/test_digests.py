"""Byte-for-byte guard for refactors of the passes (issue 12: "not one byte changes").

Each plan's whole trace set (every rank file, workload.json, summary.json less the model
file's path) is hashed; the
digests were recorded from the code before a refactor. The numbers inside are checked
independently by the other tests; this file only says whether any byte moved. A change that
is meant to move bytes updates the digests in the same commit and says why.
Regenerate: python tests/test_digests.py
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

from stg.api import generate

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
LLAMA = dict(name="d-llama", family="llama", layers=4, hidden=64, ffn=128, heads=4, kv_heads=2, vocab=512)
GPT = dict(name="d-gpt", family="gpt", layers=4, hidden=64, ffn=128, heads=4, vocab=512, max_positions=64)
MIXTRAL = dict(name="d-mixtral", family="mixtral", layers=2, hidden=64, ffn=128, heads=4, kv_heads=2, vocab=512,
               experts=4, top_k=2, moe_ffn=32)
DEEPSEEK = dict(name="d-ds", family="deepseek", layers=2, hidden=64, ffn=128, heads=4, vocab=512, experts=4,
                moe_ffn=32, top_k=2, shared_experts=1, first_dense_layers=1, q_lora_rank=32, kv_lora_rank=16,
                qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
DLRM = dict(name="d-dlrm", family="dlrm", dense_features=13, embedding_dim=16, bottom_mlp=[32, 16],
            top_mlp=[32, 1], interaction="dot", tables=[1000, 200, 50, 4000])
HF = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "tie_word_embeddings": True,
      "_name_or_path": "d-qwen2"}

PLANS = {
    "dp": (LLAMA, dict(dp=2, global_batch=4)),
    "tp-sp": (LLAMA, dict(tp=2, global_batch=2)),
    "tp-nosp": (LLAMA, dict(tp=2, sp=False, global_batch=2)),
    "cp": (LLAMA, dict(cp=2, dp=2, global_batch=2)),
    "pp-gpipe": (LLAMA, dict(pp=2, schedule="gpipe", global_batch=4)),
    "pp-1f1b": (LLAMA, dict(pp=2, tp=2, global_batch=4)),
    "pp-interleaved": (LLAMA, dict(pp=2, vpp=2, schedule="interleaved", global_batch=4)),
    "pp-zbh1": (LLAMA, dict(pp=2, schedule="zb-h1", dp=2, global_batch=8)),
    "zero1": (LLAMA, dict(dp=2, zero=1, global_batch=4)),
    "zero2": (LLAMA, dict(dp=2, zero=2, global_batch=4)),
    "zero3": (LLAMA, dict(dp=2, tp=2, zero=3, global_batch=2)),
    "recompute-selective": (LLAMA, dict(tp=2, recompute="selective", global_batch=2)),
    "recompute-full": (LLAMA, dict(dp=2, recompute="full", global_batch=2)),
    "gpt-tied-pp": (GPT, dict(pp=2, dp=2, zero=1, global_batch=8)),
    "ep-skew": (MIXTRAL, dict(dp=4, ep=2, tp=2, expert_skew=1.0, global_batch=4)),
    "ep-etp": (MIXTRAL, dict(dp=2, ep=2, tp=2, etp=2, global_batch=2)),
    "deepseek-pp": (DEEPSEEK, dict(dp=2, ep=2, pp=2, global_batch=4)),
    "fp8": (LLAMA, dict(tp=2, fp8=True, global_batch=2)),
    "dtype-fp32": (LLAMA, dict(dp=2, dtype="fp32", global_batch=2)),
    "dlrm-data_parallel": (DLRM, dict(dp=4, micro_batch=8, embedding_sharding="data_parallel")),
    "dlrm-table_wise": (DLRM, dict(dp=4, micro_batch=8, embedding_sharding="table_wise")),
    "dlrm-column_wise": (DLRM, dict(dp=4, micro_batch=8, embedding_sharding="column_wise", column_shards=2)),
    "dlrm-row_wise": (DLRM, dict(dp=4, micro_batch=8, embedding_sharding="row_wise")),
    "dlrm-table_row_wise": (DLRM, dict(dp=2, local_world_size=2, micro_batch=8,
                                       embedding_sharding="table_row_wise")),
    "described": (str(EXAMPLES / "parallel-block.yaml"), dict(dp=2, tp=2, pp=2, global_batch=8)),
    "hf": ("hf", dict(tp=2, pp=2, global_batch=4)),
}

DIGESTS = {
    "dp": "d99660e8fa0ed0f105f2ef731236da143316736c3388bc3d8098b417f46ec0a9",
    "tp-sp": "b53b2e1415ef8dbb30bd193f30adb19a8cb32381f2b31744877e814152f1de46",
    "tp-nosp": "0ae283bdb4a1fcbad84a3b690e09b78ca407f94c6443b3f282649b7b177464b3",
    "cp": "bf01942b67a37e35cc565817b5701eaeb86145a73252a7d28fffdc42a06de403",
    "pp-gpipe": "9112fddd09ebb6899993816295ec2e05997262467a5ef28ebdcf9247d952e898",
    "pp-1f1b": "2bd2a27085c35d1524ec974888d72c35a289168eda7949610b034d5dc649795f",
    "pp-interleaved": "21d7d3e37208374f8f932ae4d88a9946e2a58a01330b3b4ac08ecc1f6c0a5844",
    "pp-zbh1": "7988dad605fcffa2d744d111114c1d390f4b886204615593096e9455b51d83b7",
    "zero1": "bc142e0264ddc83d44618a568ce7e3b37c7b8fc8d5bf97f7cb1111d8b99a6504",
    "zero2": "2e4c7a8943beb46027a907082bb4cee95c550ccfcb047db0d995d49e37bdabf2",
    "zero3": "caa8c51e6f1ec6f64be684979fe5d8565439a1cd1777f7590d5ac382e379bb22",
    "recompute-selective": "8f1c19ecb6b3dd44c9c6c112bc6ed5c1c96aff20b2df9b82d6358c9a230c1953",
    "recompute-full": "683e746575263a67fb653ab21dc8ff080bf974e527b598be6563ac4085277895",
    "gpt-tied-pp": "39718ed8afe172eabadead851f3290d1d88657a03cba7d2838dad09651d7b431",
    "ep-skew": "0614787da5d2be21a351712abad8ef71ae18cd1ced2ac9af73e91ff81775d3f4",
    "ep-etp": "51998abe998c7b2ff6dc4fb6f3470dfdd0d0b2cf8efa0f2271c17b981a272384",
    "deepseek-pp": "c3419ff87460a9c47e436dbebdf0f36d666e48376677bd4d6348dde1a7d0f92d",
    "fp8": "815c0dd03598476847184604e3dbd94fcc378463456bdd1fa2eec26915953dee",
    "dtype-fp32": "b765e6ef648614e338fc50fce286f44dec73be567276cbf743f86ace56428124",
    "dlrm-data_parallel": "0375c0d7333f0023ca70a676046487bdbd7dfdd9cff69edda0325a08145b224c",
    "dlrm-table_wise": "7da8077b6238d53b8bf243eec6328d585b0e0478568c20bfbc57d3e8eb88379b",
    "dlrm-column_wise": "281d93153dcba69160fefa7446872f6efa8b174877c9f5d914b2080b2fe7935a",
    "dlrm-row_wise": "2a829a82fc193824095bf3f7d69dcfc551faa1c8e7be2a4d7a7afcfca5f6f33d",
    "dlrm-table_row_wise": "8819903b00edaf8360915ad83acc448b94390719870de7842e995ad08536f7d5",
    "described": "6cd8d3098ce677a55840b514f025f43c41fcf0aa3866f480144fd19bbe052d35",
    "hf": "f2e6ef170f8307605b4c03802d216d69927e3341e51cc0d7846955050d9d67c5",
}


def model_of(name: str, tmp: Path):
    """The model of PLANS[name], the HF config written to a config.json under `tmp`."""
    model = PLANS[name][0]
    if model == "hf":
        model = tmp / "config.json"
        model.write_text(json.dumps(HF))
        model = str(model)
    return model


def digest(name: str, tmp: Path) -> str:
    model, plan = model_of(name, tmp), PLANS[name][1]
    out = tmp / "set"
    generate(model, {"seq": 32, **plan}, out)
    h = hashlib.sha256()
    for path in sorted(out.iterdir()):
        data = path.read_bytes()
        if path.name == "summary.json":  # where the model file lies differs between checkouts
            summary = json.loads(data)
            summary["model"].pop("source")
            data = json.dumps(summary, sort_keys=True).encode()
        h.update(path.name.encode() + b"\0" + data)
    return h.hexdigest()


@pytest.mark.parametrize("name", PLANS)
def test_set_is_byte_identical_to_the_recorded_one(name, tmp_path):
    assert digest(name, tmp_path) == DIGESTS[name]


if __name__ == "__main__":  # print the DIGESTS table of the code as it is now
    import tempfile

    for name in PLANS:
        with tempfile.TemporaryDirectory() as tmp:
            print(f'    "{name}": "{digest(name, Path(tmp))}",', flush=True)
    sys.exit(0)
