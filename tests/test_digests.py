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
    "dp": "a1b46c73040dfbc0daa477f6368971e9f4a4fd6f06c5f06c6b453dafcdce802b",
    "tp-sp": "806b71b23defc2f51c0339886e1e2649ffcec26c74332b47a46287ee21c39653",
    "tp-nosp": "740c4d37e2c7b883080299eb885c555486e9abdd3f8362bc813dfe233f7612ef",
    "cp": "389f9214103e9c8c6ccdd26b23feb1829c736905708fa1f1cf994056966fce4f",
    "pp-gpipe": "c17af9a9256e854f6b4fcde4e4f7e400d5bed812e69c9376ff63d9f3477c9dc9",
    "pp-1f1b": "a132f7d88eaf1b7ce495cd30e4ecdccc92455bbaed4adfd0ba0e5e34a2af7907",
    "pp-interleaved": "c4c4738fafcb8babb7157370a1177c978c618df4525619df9b1d6386f79cbe28",
    "pp-zbh1": "93fe4c9741d2eda954d60b170f67b92b01b3ec5d0ff56fe42603cc1dacc0d70f",
    "zero1": "f3ed27784b5c6e5a5204e2d525625f9041056f8db838050874a412a81b7d8626",
    "zero2": "9c829de1088f338eaf5ea26e0567aab38f61f260aebbb07a21a4b0f44bc765d5",
    "zero3": "b27fc1ee5e06297ca723e443a622ea293cda7831b6c38aa320430395cdab1b3e",
    "recompute-selective": "1e7dde38352f8f505f243dd5710482104f4f05ff8740bd9af4e9117b0629eed4",
    "recompute-full": "5af9c706c728f4da5cce07b2e153f8d170d6ad8fe8a3f1f1ac5ef15e3dbcfd00",
    "gpt-tied-pp": "350ee61000fad739d785e1e34ee26d466ee069a6d5cdb1c1daa406b04c64cf3a",
    "ep-skew": "7e4e1422c802be682f31fa5917a2565e8f242b7e79240a5aebdc851e8a3305dd",
    "ep-etp": "01968360f9c650064d166bab11b7c65da5e3ed6f902b49b54f557f60b790e9b2",
    "deepseek-pp": "5ff83021d13da04ecb25476de1bab36200d51d63791f52ee324a0d75e32d3890",
    "fp8": "823eac2c77b6f4fbbfc810772d19fd71707875108baa417559d50e66a66cbb91",
    "dtype-fp32": "731397287ee6b9bf39561ef7100903e52756b0d9d70d3fbaa352c0f6a2109a9f",
    "dlrm-data_parallel": "0375c0d7333f0023ca70a676046487bdbd7dfdd9cff69edda0325a08145b224c",
    "dlrm-table_wise": "7da8077b6238d53b8bf243eec6328d585b0e0478568c20bfbc57d3e8eb88379b",
    "dlrm-column_wise": "281d93153dcba69160fefa7446872f6efa8b174877c9f5d914b2080b2fe7935a",
    "dlrm-row_wise": "2a829a82fc193824095bf3f7d69dcfc551faa1c8e7be2a4d7a7afcfca5f6f33d",
    "dlrm-table_row_wise": "8819903b00edaf8360915ad83acc448b94390719870de7842e995ad08536f7d5",
    "described": "57d151d3c2226db526f3df18a6924f40a44e84824e97ce994acedd3bcaf3ca58",
    "hf": "cb19c6faf38ff37be77c939829194d8b5ee09df7565afc91ae2de0759246ba9a",
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
