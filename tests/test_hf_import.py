"""HuggingFace config.json import, with the public configs' values written out here."""

import json

import pytest

from model_zoo import load_model
from stg.errors import ModelSpecError

LLAMA3_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False,
             "rope_theta": 500000.0, "_name_or_path": "meta-llama/Meta-Llama-3-8B"}
MIXTRAL = {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000, "num_local_experts": 8,
           "num_experts_per_tok": 2, "tie_word_embeddings": False}
QWEN2_7B = {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
            "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False}
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
               "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
               "num_key_value_heads": 128, "vocab_size": 129280, "n_routed_experts": 256, "n_shared_experts": 1,
               "num_experts_per_tok": 8, "first_k_dense_replace": 3, "q_lora_rank": 1536, "kv_lora_rank": 512,
               "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "tie_word_embeddings": False}


def write(tmp_path, config, name="config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return path


def qwen2_by_hand(c):
    h, f, a, kv, v, layers = (c[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                             "num_key_value_heads", "vocab_size", "num_hidden_layers"))
    d = h // a
    attention = h * a * d + a * d + 2 * (h * kv * d + kv * d) + a * d * h  # q, k, v with biases; o without
    return 2 * v * h + layers * (attention + 3 * h * f + 2 * h) + h


def deepseek_by_hand(c):
    h, heads = c["hidden_size"], c["num_attention_heads"]
    ql, kl, dn, dr, dv = (c[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    attention = h * ql + ql + ql * heads * (dn + dr) + h * (kl + dr) + kl + kl * heads * (dn + dv) + heads * dv * h
    dense, moe = c["first_k_dense_replace"], c["num_hidden_layers"] - c["first_k_dense_replace"]
    experts = h * c["n_routed_experts"] + (c["n_routed_experts"] + c["n_shared_experts"]) * 3 * h * c["moe_intermediate_size"]
    layers = c["num_hidden_layers"] * (attention + 2 * h) + dense * 3 * h * c["intermediate_size"] + moe * experts
    return 2 * c["vocab_size"] * h + layers + h


@pytest.mark.parametrize("config, params", [
    (LLAMA3_8B, 8_030_261_248),
    (MIXTRAL, 46_702_792_704),
    (QWEN2_7B, qwen2_by_hand(QWEN2_7B)),
    (DEEPSEEK_V3, deepseek_by_hand(DEEPSEEK_V3)),
    # Qwen3-8B: per-head q/k RMSNorm; HuggingFace reports 8,190,735,360
    ({"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
      "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
      "tie_word_embeddings": False}, 8_190_735_360),
    # GPT-2 small: 124,439,808
    ({"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024, "vocab_size": 50257},
     124_439_808),
])
def test_parameter_counts(tmp_path, config, params):
    assert load_model(str(write(tmp_path, config))).params == params


def test_qwen2_by_hand_is_huggingfaces_count():
    assert qwen2_by_hand(QWEN2_7B) == 7_615_616_512  # Qwen/Qwen2-7B
    assert deepseek_by_hand(DEEPSEEK_V3) == 671_026_404_352


def test_a_folder_holding_config_json(tmp_path):
    write(tmp_path, LLAMA3_8B)
    model = load_model(str(tmp_path))
    assert model.name == "Meta-Llama-3-8B" and model.params == 8_030_261_248


@pytest.mark.parametrize("config, message", [
    ({"model_type": "bert"}, "model_type 'bert' is not supported; supported: llama"),
    ({k: v for k, v in LLAMA3_8B.items() if k != "hidden_size"}, "needs field 'hidden_size'"),
])
def test_bad_configs(tmp_path, config, message):
    with pytest.raises(ModelSpecError, match=message):
        load_model(str(write(tmp_path, config)))
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ModelSpecError, match="not valid JSON"):
        load_model(str(tmp_path / "broken.json"))
