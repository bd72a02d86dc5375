"""Decoder-only transformers: GPT-style and Llama-style blocks from one builder.

The forward graph of one micro-batch, all sizes symbolic. Every tensor dimension carries a
logical axis name, which is what strategies map to mesh axes (DESIGN.md, "Logical axes"):

  batch, seq, embed, vocab, positions, kv_heads, q_per_kv, head_dim, mlp

Query heads are laid out as [kv_heads, q_per_kv]: grouped-query attention shares one K/V head
among q_per_kv query heads, and splitting kv_heads keeps each group on one rank (Megatron's
split when tp divides the KV heads). Multi-head attention is the case q_per_kv = 1.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import sympy

from model_zoo import moe
from stg.builder import GraphBuilder
from stg.costs import NormKind, Pointwise
from stg.errors import ModelSpecError
from stg.graph import DType, Graph
from stg.limits import MAX_LAYERS, check_int, check_number
from stg.symbols import ATTN_FRACTION, B, KV_TOKENS, PAIRS, S, SAMPLED

MODEL_DTYPES = ("bf16", "fp16", "fp32")
H, F, A, AKV, DH, V, P = sympy.symbols("H F A Akv Dh V P", positive=True, integer=True)

FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    # GPT-2/3: LayerNorm with bias, GELU MLP of 4h, learned positions, biases on every linear,
    # output layer tied to the token embedding.
    "gpt": dict(norm="layernorm", mlp="gelu", bias=True, positions="learned", tied_embeddings=True, dropout=0.1),
    # Llama: RMSNorm, SwiGLU MLP, rotary positions, no biases, untied output layer.
    "llama": dict(norm="rmsnorm", mlp="swiglu", bias=False, positions="rope", tied_embeddings=False, dropout=0.0),
}
# Mixture-of-experts families: Llama-style blocks whose MLPs are routed experts (Mixtral),
# and DeepSeek-V2/V3 with multi-head latent attention, shared experts and dense first layers.
FAMILY_DEFAULTS["mixtral"] = dict(FAMILY_DEFAULTS["llama"], top_k=2)
FAMILY_DEFAULTS["deepseek"] = dict(FAMILY_DEFAULTS["llama"], attention="mla", top_k=8)


@dataclass(frozen=True)
class TransformerConfig:
    name: str
    family: str
    layers: int
    hidden: int
    ffn: int
    heads: int
    vocab: int
    kv_heads: int | None = None
    head_dim: int | None = None
    max_positions: int | None = None
    norm: str | None = None
    mlp: str | None = None
    bias: bool | None = None
    positions: str | None = None
    tied_embeddings: bool | None = None
    dropout: float | None = None  # probability; > 0 adds GPT-2's embedding, attention and residual dropout
    qkv_bias: bool = False  # biases on the query, key and value projections only (Qwen2)
    qk_norm: bool = False  # RMSNorm on each head's queries and keys (Qwen3)
    # mixture of experts (experts set): E routed experts of width moe_ffn, top_k per token,
    # shared_experts always-on experts of the same width, the first first_dense_layers dense
    experts: int | None = None
    top_k: int | None = None
    moe_ffn: int | None = None
    shared_experts: int = 0
    first_dense_layers: int = 0
    # multi-head latent attention (attention: mla)
    attention: str = "gqa"
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    # weights, activations and their communication: bf16, fp16 or fp32 (the optimizer keeps
    # fp32 master weights and moments of 16-bit ones; a plan's dtype overrides this)
    dtype: str = "bf16"

    @classmethod
    def from_dict(cls, spec: dict) -> "TransformerConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ModelSpecError(f"model {spec.get('name')!r}: unknown field(s) {unknown}; known: {sorted(known)}")
        family = spec.get("family")
        if family not in FAMILY_DEFAULTS:
            raise ModelSpecError(
                f"model {spec.get('name')!r}: family must be one of {sorted(FAMILY_DEFAULTS)}, got {family!r}"
            )
        merged = {**FAMILY_DEFAULTS[family], **spec}
        for required in ("name", "layers", "hidden", "ffn", "heads", "vocab"):
            if merged.get(required) is None:
                raise ModelSpecError(f"model {spec.get('name')!r}: missing field {required!r}")
        config = cls(**merged)
        config._check()
        return config

    def _check(self) -> None:
        where = f"model {self.name!r}"
        check_int(f"{where}: layers", self.layers, ModelSpecError, maximum=MAX_LAYERS)
        for key in ("hidden", "ffn", "heads", "vocab", "kv_heads", "head_dim", "max_positions", "experts", "top_k",
                    "moe_ffn", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, key) is not None:
                check_int(f"{where}: {key}", getattr(self, key), ModelSpecError)
        for key in ("shared_experts", "first_dense_layers"):
            check_int(f"{where}: {key}", getattr(self, key), ModelSpecError, minimum=0)
        for key in ("bias", "tied_embeddings", "qkv_bias", "qk_norm"):
            if not isinstance(getattr(self, key), bool):
                raise ModelSpecError(f"{where}: {key}: must be true or false, got {getattr(self, key)!r}")
        if self.family in ("mixtral", "deepseek") and self.experts is None:
            raise ModelSpecError(f"{where}: family {self.family} is a mixture of experts; give experts")
        if self.head_dim is None and self.hidden % self.heads:
            raise ModelSpecError(f"{where}: heads={self.heads} does not divide hidden={self.hidden}; give head_dim")
        if self.heads % self.kv_heads_count:
            raise ModelSpecError(f"{where}: kv_heads={self.kv_heads_count} does not divide heads={self.heads}")
        if self.positions == "learned" and self.max_positions is None:
            raise ModelSpecError(f"{where}: learned positions need max_positions")
        check_number(f"{where}: dropout", self.dropout, ModelSpecError, inclusive=True, maximum=0.999999)
        if self.experts is not None:
            for key in ("top_k", "moe_ffn"):
                if getattr(self, key) is None:
                    raise ModelSpecError(f"{where}: a mixture of experts needs {key}")
            if self.top_k > self.experts:
                raise ModelSpecError(f"{where}: top_k={self.top_k} exceeds experts={self.experts}")
            if self.mlp != "swiglu":
                raise ModelSpecError(f"{where}: experts are SwiGLU MLPs; mlp must be swiglu")
        if not 0 <= self.first_dense_layers <= self.layers:
            raise ModelSpecError(f"{where}: first_dense_layers={self.first_dense_layers} is not within 0..{self.layers}")
        if self.attention == "mla":
            for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                if getattr(self, key) is None:
                    raise ModelSpecError(f"{where}: multi-head latent attention needs {key}")
        choices = {"norm": ("layernorm", "rmsnorm"), "mlp": ("gelu", "swiglu"), "positions": ("learned", "rope"),
                   "attention": ("gqa", "mla"), "dtype": MODEL_DTYPES}
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise ModelSpecError(f"{where}: {key} must be one of {list(allowed)}, got {getattr(self, key)!r}")

    @property
    def kv_heads_count(self) -> int:
        return self.kv_heads or self.heads

    def sizes(self, vocab_multiple: int = 1) -> dict[sympy.Symbol, int]:
        """Values of this family's symbols; the vocabulary padded up to a multiple of
        `vocab_multiple` (Megatron pads it so that tensor parallelism divides it)."""
        sizes = {
            H: self.hidden,
            F: self.ffn,
            A: self.heads,
            AKV: self.kv_heads_count,
            DH: self.head_dim or self.hidden // self.heads,
            V: -(-self.vocab // vocab_multiple) * vocab_multiple,
        }
        if self.positions == "learned":
            sizes[P] = self.max_positions
        if self.experts is not None:
            sizes.update({moe.E: self.experts, moe.K: self.top_k, moe.FE: self.moe_ffn, moe.NS: self.shared_experts})
        if self.attention == "mla":
            sizes.update({moe.KL: self.kv_lora_rank, moe.DN: self.qk_nope_head_dim,
                          moe.DR: self.qk_rope_head_dim, moe.DV: self.v_head_dim})
            if self.q_lora_rank is not None:  # none: queries projected directly (DeepSeek-V2-Lite)
                sizes[moe.QL] = self.q_lora_rank
        return sizes


def _layer_template(g: GraphBuilder, start: tuple[int, int], prefix: str, stream: str, out: str) -> tuple | None:
    """The layer just built as the later layers of its kind copy it: its block, the residual
    stream it read and the one it made; None where it reads anything else from before it."""
    block = g.block(start, prefix)
    return (block, stream, out) if block is not None and block.reads <= {stream} else None


def _copy_layer(g: GraphBuilder, template: tuple, prefix: str, stream: str) -> str:
    """A layer that copies `template` (from _layer_template) under `prefix`, reading `stream`;
    the residual stream it makes."""
    block, old_stream, out = template
    rename = {**block.renaming(prefix), old_stream: stream}
    g.add_copy(block, rename, g.layer)
    return rename[out]


def build_transformer(config: TransformerConfig, flash_attention: bool = True, fp8: bool = False,
                      fp8_params: bool = False, kv_cache: DType | None = None) -> Graph:
    """Forward graph of one micro-batch of B sequences of S tokens, loss included.

    Tensors that re-enter the residual stream are anchored with the tag "residual", so that a
    plan can lay the stream out its own way (sequence parallelism splits it on seq). With
    `flash_attention` the score and probability matrices stay on chip: FLOPs, no memory.
    The attention core's ops carry `attention_core` (what selective recompute re-runs).
    With `fp8` the blocks' linear layers (q, k, v, out, and the dense MLP's) follow
    Transformer Engine's recipe: their input is cast to fp8 once (the fp8 copy is what the
    GEMM reads and the backward keeps), the GEMMs (forward, input and weight gradient) carry
    `fp8` and run at the device's fp8 peak, the weights keep their 16-bit copy (autodiff adds
    the per-step fp8 cast). Experts, MLA projections and the output layer stay 16-bit.
    With `fp8_params` (Megatron's --fp8-param-gather) those weights are stored in fp8 only:
    gathered in fp8, updated from the fp32 master copy straight into fp8.

    With `kv_cache` (the cache's dtype) it is one inference step instead (stg/serve): each of
    the B sequences is one engine's step, its S tokens packed, attention one fused op over each
    layer's K/V cache of KV_TOKENS tokens, the LM head on the SAMPLED positions only, then
    sampling (a softmax over the vocabulary); no labels, no loss.
    """
    g = GraphBuilder(weight_dtype=DType.parse(config.dtype))
    bias = config.bias
    dropout = config.dropout > 0
    norm = NormKind.LAYER_NORM if config.norm == "layernorm" else NormKind.RMS_NORM
    groups = A / AKV
    core = {"attention_core": True}

    def norm_op(name: str, x: str) -> str:
        weight = g.weight(f"{name}.weight", [H], ["embed"])
        b = g.weight(f"{name}.bias", [H], ["embed"]) if config.norm == "layernorm" else None
        return g.norm(name, norm, x, weight, b)

    fp8_copies: dict[str, str] = {}  # a linear input -> its fp8 copy (q, k and v share one)

    def gemm(name: str, spec: str, x: str, weight: str) -> str:
        if not fp8:
            return g.einsum(name, spec, x, weight)
        if x not in fp8_copies:
            fp8_copies[x] = g.cast(f"{x}.fp8", x, DType.FP8)
        return g.einsum(name, spec, fp8_copies[x], weight, fp8=True)

    def linear(name: str, spec: str, x: str, shape: list, dims: list[str], bias_shape: list,
               bias_dims: list[str], residual: bool = False, bias: bool = bias) -> str:
        """x @ W (+ b). A `residual` output is anchored to the residual stream's layout
        before its bias and dropout, where Megatron reduces a row-parallel output."""
        weight = g.weight(f"{name}.weight", shape, dims, DType.FP8 if fp8_params else None)
        if not bias and not residual:
            return gemm(name, spec, x, weight)
        out = gemm(f"{name}.matmul", spec, x, weight)
        if residual:
            out = g.constrain(f"{name}.matmul.residual" if bias else name, out, "residual")
        if bias:
            out = g.pointwise(name, Pointwise.ADD, out, g.weight(f"{name}.bias", bias_shape, bias_dims))
        return g.dropout(f"{name}.dropout", out) if residual and dropout else out

    def gqa_attention(p: str, h: str) -> str:
        """Grouped-query (multi-head when kv_heads = heads) attention; its output anchored."""
        qkv_bias = bias or config.qkv_bias
        q = linear(f"{p}.attn.q", "bsh,hngd->bsngd", h, [H, AKV, groups, DH],
                   ["embed", "kv_heads", "q_per_kv", "head_dim"], [AKV, groups, DH], ["kv_heads", "q_per_kv", "head_dim"],
                   bias=qkv_bias)
        k = linear(f"{p}.attn.k", "bsh,hnd->bsnd", h, [H, AKV, DH],
                   ["embed", "kv_heads", "head_dim"], [AKV, DH], ["kv_heads", "head_dim"], bias=qkv_bias)
        v = linear(f"{p}.attn.v", "bsh,hnd->bsnd", h, [H, AKV, DH],
                   ["embed", "kv_heads", "head_dim"], [AKV, DH], ["kv_heads", "head_dim"], bias=qkv_bias)
        if config.qk_norm:  # Qwen3: RMSNorm over each head's query and key
            q = g.norm(f"{p}.attn.q_norm", NormKind.RMS_NORM, q, g.weight(f"{p}.attn.q_norm.weight", [DH], ["head_dim"]))
            k = g.norm(f"{p}.attn.k_norm", NormKind.RMS_NORM, k, g.weight(f"{p}.attn.k_norm.weight", [DH], ["head_dim"]))
        if config.positions == "rope":
            q = g.pointwise(f"{p}.attn.q_rope", Pointwise.ROPE, q)
            k = g.pointwise(f"{p}.attn.k_rope", Pointwise.ROPE, k)
        if kv_cache is not None:
            caches = [g.input(f"{p}.attn.{n}_cache", [B, KV_TOKENS, AKV, DH],
                              ["batch", "kv_tokens", "kv_heads", "head_dim"], kv_cache) for n in "kv"]
            context = g.attention(f"{p}.attn.core", q, (k, v), caches, pairs=PAIRS)
            return linear(f"{p}.attn.out", "bsngd,ngdh->bsh", context, [AKV, groups, DH, H],
                          ["kv_heads", "q_per_kv", "head_dim", "embed"], [H], ["embed"], residual=True)
        scores = g.einsum(f"{p}.attn.scores", "bsngd,btnd->bngst", q, k, density=ATTN_FRACTION,
                          transient=flash_attention, **core)
        probs = g.softmax(f"{p}.attn.probs", scores, **core)
        if dropout:
            probs = g.dropout(f"{p}.attn.probs_dropout", probs, **core)
        context = g.einsum(f"{p}.attn.context", "bngst,btnd->bsngd", probs, v, density=ATTN_FRACTION, **core)
        out = linear(f"{p}.attn.out", "bsngd,ngdh->bsh", context, [AKV, groups, DH, H],
                     ["kv_heads", "q_per_kv", "head_dim", "embed"], [H], ["embed"], residual=True)
        return out

    def mlp_block(p: str, x: str, moe_layer: bool) -> str:
        """Norm, then a dense MLP or routed (and shared) experts, then the residual add."""
        h = norm_op(f"{p}.mlp_norm", x)
        if moe_layer:
            routed, shared = moe.moe_mlp(g, p, h, H, shared=config.shared_experts > 0)
            if shared is not None:
                routed = g.pointwise(f"{p}.moe_sum", Pointwise.ADD, routed, shared)
            return g.pointwise(f"{p}.mlp_residual", Pointwise.ADD, x, routed)
        if config.mlp == "swiglu":
            gate = linear(f"{p}.mlp.gate", "bsh,hf->bsf", h, [H, F], ["embed", "mlp"], [F], ["mlp"])
            up = linear(f"{p}.mlp.up", "bsh,hf->bsf", h, [H, F], ["embed", "mlp"], [F], ["mlp"])
            act = g.pointwise(f"{p}.mlp.act", Pointwise.SWIGLU, gate, up)
        else:
            up = linear(f"{p}.mlp.up", "bsh,hf->bsf", h, [H, F], ["embed", "mlp"], [F], ["mlp"])
            act = g.pointwise(f"{p}.mlp.act", Pointwise.GELU, up)
        down = linear(f"{p}.mlp.down", "bsf,fh->bsh", act, [F, H], ["mlp", "embed"], [H], ["embed"], residual=True)
        return g.pointwise(f"{p}.mlp_residual", Pointwise.ADD, x, down)

    # -- layer 0: embeddings -------------------------------------------------------------------
    g.layer = 0
    ids = g.input("tokens", [B, S], ["batch", "seq"])
    labels = g.input("labels", [B, S], ["batch", "seq"]) if kv_cache is None else None
    table = g.weight("embed.weight", [V, H], ["vocab", "embed"])
    x = g.constrain("embed.out", g.embedding("embed", table, ids), "residual")
    if config.positions == "learned":
        positions = g.input("positions", [S], ["seq"])
        pos_table = g.weight("pos_embed.weight", [P, H], ["positions", "embed"])
        x = g.pointwise("embed_sum", Pointwise.ADD, x, g.embedding("pos_embed", pos_table, positions))
    if dropout:
        x = g.dropout("embed.dropout", x)

    # -- layers 1..L -----------------------------------------------------------------------------
    built: dict[bool, tuple | None] = {}  # a layer of each kind (dense, MoE) built op by op: the others copy it
    for i in range(1, config.layers + 1):
        g.layer = i
        p = f"layers.{i - 1}"
        moe_layer = config.experts is not None and i > config.first_dense_layers
        if built.get(moe_layer) is not None:
            x = _copy_layer(g, built[moe_layer], p, x)
            continue
        start, stream = g.mark(), x
        h = norm_op(f"{p}.attn_norm", x)
        if config.attention == "mla":
            if kv_cache is not None and config.q_lora_rank is None:
                raise ModelSpecError(f"model {config.name}: serving MLA without q_lora_rank (DeepSeek-V2-Lite) "
                                     "is not supported yet")
            out = (moe.mla(g, p, h, H, A, flash_attention, q_lora=config.q_lora_rank is not None)
                   if kv_cache is None else moe.mla_cached(g, p, h, H, A, kv_cache, PAIRS, KV_TOKENS))
        else:
            out = gqa_attention(p, h)
        x = g.pointwise(f"{p}.attn_residual", Pointwise.ADD, x, out)
        x = mlp_block(p, x, moe_layer)
        if moe_layer not in built:
            built[moe_layer] = _layer_template(g, start, p, stream, x)

    # -- layer L+1: output head and loss ---------------------------------------------------------
    g.layer = config.layers + 1
    x = norm_op("final_norm", x)
    head = table if config.tied_embeddings else g.weight("lm_head.weight", [V, H], ["vocab", "embed"])
    if kv_cache is not None:  # the positions that yield a token, then sampling over the vocabulary
        x = g.gather("sampled", x, [B, SAMPLED, H], ["batch", "sampled", "embed"])
        g.softmax("sample", g.einsum("logits", "bnh,vh->bnv", x, head))
        return g.build()
    logits = g.einsum("logits", "bsh,vh->bsv", x, head)
    g.cross_entropy("loss", logits, labels)
    return g.build()
