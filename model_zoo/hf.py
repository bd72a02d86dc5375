"""HuggingFace `config.json` import: a local file (no network) mapped onto a zoo family.

Supported `model_type`s: llama, mistral, qwen2, qwen3 (Llama-style blocks; Qwen2 adds biases
on q/k/v, Qwen3 per-head q/k RMSNorm), mixtral, deepseek_v3, gpt2. The result is the same
dict of sizes a model YAML holds, so an imported model behaves exactly like a zoo one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from stg.errors import ModelSpecError


def _llama(c: Callable[..., Any]) -> dict:
    spec = dict(
        family="llama",
        layers=c("num_hidden_layers"),
        hidden=c("hidden_size"),
        ffn=c("intermediate_size"),
        heads=c("num_attention_heads"),
        kv_heads=c("num_key_value_heads", c("num_attention_heads")),
        vocab=c("vocab_size"),
        tied_embeddings=c("tie_word_embeddings", False),
    )
    if c("head_dim", None) is not None:
        spec["head_dim"] = c("head_dim")
    return spec


def _qwen2(c) -> dict:
    return {**_llama(c), "qkv_bias": True}


def _qwen3(c) -> dict:
    return {**_llama(c), "qk_norm": True}


def _mixtral(c) -> dict:
    return {**_llama(c), "family": "mixtral", "experts": c("num_local_experts"), "top_k": c("num_experts_per_tok"),
            "moe_ffn": c("intermediate_size")}


def _deepseek_v3(c) -> dict:
    return {
        **_llama(c),
        "family": "deepseek",
        "experts": c("n_routed_experts"),
        "top_k": c("num_experts_per_tok"),
        "moe_ffn": c("moe_intermediate_size"),
        "shared_experts": c("n_shared_experts", 0),
        "first_dense_layers": c("first_k_dense_replace", 0),
        "q_lora_rank": c("q_lora_rank", None),  # null in DeepSeek-V2-Lite: queries without compression
        "kv_lora_rank": c("kv_lora_rank"),
        "qk_nope_head_dim": c("qk_nope_head_dim"),
        "qk_rope_head_dim": c("qk_rope_head_dim"),
        "v_head_dim": c("v_head_dim"),
    }


def _gpt2(c) -> dict:
    hidden = c("n_embd")
    return dict(family="gpt", layers=c("n_layer"), hidden=hidden, ffn=c("n_inner", None) or 4 * hidden,
                heads=c("n_head"), vocab=c("vocab_size"), max_positions=c("n_positions"),
                tied_embeddings=c("tie_word_embeddings", True))


MODEL_TYPES: dict[str, Callable] = {
    "llama": _llama,
    "mistral": _llama,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "mixtral": _mixtral,
    "deepseek_v3": _deepseek_v3,
    "gpt2": _gpt2,
}


def _no_constant(name: str):
    raise ValueError(f"{name} is not a size (JSON has no NaN or Infinity)")


def from_hf_config(path: str | Path) -> dict:
    """The model dict for a HuggingFace config.json (a file, or a folder holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        config = json.loads(path.read_bytes().decode("utf-8"), parse_constant=_no_constant)
    except OSError as err:
        raise ModelSpecError(f"HuggingFace config {path}: cannot read ({err.strerror})") from None
    except UnicodeDecodeError as err:
        raise ModelSpecError(f"HuggingFace config {path}: not UTF-8 text (byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise ModelSpecError(f"HuggingFace config {path}: not valid JSON ({err.msg}, line {err.lineno})") from None
    except (RecursionError, ValueError) as err:
        raise ModelSpecError(f"HuggingFace config {path}: {err if isinstance(err, ValueError) else 'nested too deeply'}") from None
    if not isinstance(config, dict):
        raise ModelSpecError(f"HuggingFace config {path}: expected a JSON object")
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ModelSpecError(
            f"HuggingFace config {path}: model_type {model_type!r} is not supported; supported: {', '.join(MODEL_TYPES)}"
        )
    missing = object()

    def field(key: str, default: Any = missing) -> Any:
        if key in config and config[key] is not None:
            return config[key]
        if default is missing:
            raise ModelSpecError(f"HuggingFace config {path}: model_type {model_type!r} needs field {key!r}")
        return default

    name = config.get("_name_or_path") or (path.stem if path.stem != "config" else path.parent.name)
    return {"name": str(name).rstrip("/").split("/")[-1] or model_type, **MODEL_TYPES[model_type](field)}
