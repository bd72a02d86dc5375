"""Mixture-of-experts feed-forward and multi-head latent attention (DeepSeek-V2/V3) blocks.

Both are used by the transformer builder (model_zoo/transformer.py) when a config asks for
them. Logical axes: `expert` (split by expert parallelism), `capacity` (a buffer's token
slots), `expert_mlp` (an expert's hidden width; not split by tensor parallelism: etp = 1),
`heads` (MLA query heads, split by tensor parallelism), `q_lora`, `kv_lora`, `rope_dim`,
`nope_dim`, `v_dim`.

Buffers have capacity_factor * k * tokens / E token slots per expert (symbol CF, a plan
input), padded up per rank, so the all-to-alls are even. Under routing skew (a plan's
expert_skew, a Zipf exponent) the experts' GEMMs do LOAD times the balanced work on the
tokens an expert slot actually receives, LOAD being bound per expert-parallel rank class.
"""

from __future__ import annotations

import sympy

from stg.builder import GraphBuilder
from stg.costs import NormKind, Pointwise
from stg.symbols import ATTN_FRACTION, B, S

E, K, FE, NS = sympy.symbols("E K Fe Ns", positive=True, integer=True)
CF = sympy.Symbol("CF", positive=True)  # capacity factor
# An expert slot's load relative to balanced routing (1 balanced): its experts' GEMMs do
# LOAD times the balanced work. Bound per rank class under routing skew.
LOAD = sympy.Symbol("LOAD", positive=True)
QL, KL, DN, DR, DV = sympy.symbols("Ql Kl Dn Dr Dv", positive=True, integer=True)


def moe_mlp(g: GraphBuilder, p: str, h: str, hidden, shared: bool) -> tuple[str, str | None]:
    """Router, top-k, dispatch, E SwiGLU experts, combine; and the shared experts' SwiGLU
    (NS experts of width Fe side by side). Returns the routed and the shared output."""
    router = g.weight(f"{p}.router.weight", [hidden, E], ["embed", "experts_all"])
    gates = g.route(f"{p}.router.gates", g.einsum(f"{p}.router.logits", "bsh,he->bse", h, router), K)
    tokens = g.dispatch(f"{p}.experts.dispatch", h, gates, CF * K * B * S / E)

    def expert(name: str, spec: str, x: str, shape: list, dims: list[str]) -> str:
        weight = g.weight(f"{p}.experts.{name}.weight", shape, dims)
        return g.einsum(f"{p}.experts.{name}", spec, x, weight, density=LOAD)

    gate = expert("gate", "ech,ehf->ecf", tokens, [E, hidden, FE], ["expert", "embed", "expert_mlp"])
    up = expert("up", "ech,ehf->ecf", tokens, [E, hidden, FE], ["expert", "embed", "expert_mlp"])
    act = g.pointwise(f"{p}.experts.act", Pointwise.SWIGLU, gate, up)
    down = expert("down", "ecf,efh->ech", act, [E, FE, hidden], ["expert", "expert_mlp", "embed"])
    routed = g.constrain(f"{p}.experts.out", g.combine(f"{p}.experts.combine", down, gates), "residual")
    if not shared:
        return routed, None
    width = NS * FE
    s_gate = g.einsum(f"{p}.shared.gate", "bsh,hf->bsf", h, g.weight(f"{p}.shared.gate.weight", [hidden, width], ["embed", "mlp"]))
    s_up = g.einsum(f"{p}.shared.up", "bsh,hf->bsf", h, g.weight(f"{p}.shared.up.weight", [hidden, width], ["embed", "mlp"]))
    s_act = g.pointwise(f"{p}.shared.act", Pointwise.SWIGLU, s_gate, s_up)
    s_down = g.einsum(f"{p}.shared.down.matmul", "bsf,fh->bsh", s_act,
                      g.weight(f"{p}.shared.down.weight", [width, hidden], ["mlp", "embed"]))
    return routed, g.constrain(f"{p}.shared.out", s_down, "residual")


def mla(g: GraphBuilder, p: str, h: str, hidden, heads, flash: bool, rope: bool = True,
        q_lora: bool = True) -> str:
    """DeepSeek's multi-head latent attention: queries through a low-rank (q_lora) bottleneck
    (or, without q_lora as in DeepSeek-V2-Lite, one direct projection), keys and values
    through a shared kv_lora latent, a decoupled rotary part of the keys shared by all heads.
    The fused projections are kept as separate weights of the same total size
    (q_b = [nope | rope], kv_a = [latent | rope], kv_b = [k_nope | v])."""
    core = {"attention_core": True}

    def proj(name: str, spec: str, x: str, shape: list, dims: list[str]) -> str:
        return g.einsum(f"{p}.attn.{name}", spec, x, g.weight(f"{p}.attn.{name}.weight", shape, dims))

    def rms(name: str, x: str, size, dim: str) -> str:
        return g.norm(f"{p}.attn.{name}", NormKind.RMS_NORM, x, g.weight(f"{p}.attn.{name}.weight", [size], [dim]))

    if q_lora:
        cq = rms("q_a_norm", proj("q_a", "bsh,hq->bsq", h, [hidden, QL], ["embed", "q_lora"]), QL, "q_lora")
        q_nope = proj("q_b_nope", "bsq,qad->bsad", cq, [QL, heads, DN], ["q_lora", "heads", "nope_dim"])
        q_rope = proj("q_b_rope", "bsq,qar->bsar", cq, [QL, heads, DR], ["q_lora", "heads", "rope_dim"])
    else:
        q_nope = proj("q_nope", "bsh,had->bsad", h, [hidden, heads, DN], ["embed", "heads", "nope_dim"])
        q_rope = proj("q_rope", "bsh,har->bsar", h, [hidden, heads, DR], ["embed", "heads", "rope_dim"])
    ckv = rms("kv_a_norm", proj("kv_a", "bsh,hc->bsc", h, [hidden, KL], ["embed", "kv_lora"]), KL, "kv_lora")
    k_rope = proj("kv_a_rope", "bsh,hr->bsr", h, [hidden, DR], ["embed", "rope_dim"])
    if rope:
        q_rope = g.pointwise(f"{p}.attn.q_rope_rotary", Pointwise.ROPE, q_rope)
        k_rope = g.pointwise(f"{p}.attn.k_rope_rotary", Pointwise.ROPE, k_rope)
    k_nope = proj("kv_b_k", "bsc,cad->bsad", ckv, [KL, heads, DN], ["kv_lora", "heads", "nope_dim"])
    v = proj("kv_b_v", "bsc,cav->bsav", ckv, [KL, heads, DV], ["kv_lora", "heads", "v_dim"])
    nope = g.einsum(f"{p}.attn.scores_nope", "bsad,btad->bast", q_nope, k_nope, density=ATTN_FRACTION,
                    transient=flash, **core)
    pos = g.einsum(f"{p}.attn.scores_rope", "bsar,btr->bast", q_rope, k_rope, density=ATTN_FRACTION,
                   transient=flash, **core)
    scores = g.pointwise(f"{p}.attn.scores", Pointwise.ADD, nope, pos)
    probs = g.softmax(f"{p}.attn.probs", scores, **core)
    context = g.einsum(f"{p}.attn.context", "bast,btav->bsav", probs, v, density=ATTN_FRACTION, **core)
    out = proj("out.matmul", "bsav,avh->bsh", context, [heads, DV, hidden], ["heads", "v_dim", "embed"])
    return g.constrain(f"{p}.attn.out", out, "residual")


def mla_cached(g: GraphBuilder, p: str, h: str, hidden, heads, cache_dtype, pairs, kv_tokens) -> str:
    """Multi-head latent attention of one inference step over a cache of latents (vLLM's MLA
    backend, weights absorbed): each token caches its kv_lora latent and shared rotary key
    ([Kl + Dr] per layer, every tp rank the whole cache); queries are taken into the latent
    space by the keys' up-projection (q_nope x kv_b_k), attend to the cached [latent | rope]
    like multi-query attention over Kl + Dr, and the context, a latent per head, leaves through
    the values' up-projection (kv_b_v)."""
    from stg.symbols import B, S

    def proj(name: str, spec: str, x: str, shape: list, dims: list[str]) -> str:
        return g.einsum(f"{p}.attn.{name}", spec, x, g.weight(f"{p}.attn.{name}.weight", shape, dims))

    def rms(name: str, x: str, size, dim: str) -> str:
        return g.norm(f"{p}.attn.{name}", NormKind.RMS_NORM, x, g.weight(f"{p}.attn.{name}.weight", [size], [dim]))

    cq = rms("q_a_norm", proj("q_a", "bsh,hq->bsq", h, [hidden, QL], ["embed", "q_lora"]), QL, "q_lora")
    q_nope = proj("q_b_nope", "bsq,qad->bsad", cq, [QL, heads, DN], ["q_lora", "heads", "nope_dim"])
    q_rope = g.pointwise(f"{p}.attn.q_rope_rotary", Pointwise.ROPE,
                         proj("q_b_rope", "bsq,qar->bsar", cq, [QL, heads, DR], ["q_lora", "heads", "rope_dim"]))
    ckv = rms("kv_a_norm", proj("kv_a", "bsh,hc->bsc", h, [hidden, KL], ["embed", "kv_lora"]), KL, "kv_lora")
    k_rope = g.pointwise(f"{p}.attn.k_rope_rotary", Pointwise.ROPE,
                         proj("kv_a_rope", "bsh,hr->bsr", h, [hidden, DR], ["embed", "rope_dim"]))
    entry = g.concat(f"{p}.attn.cache_entry", [ckv, k_rope], [B, S, KL + DR], ["batch", "seq", "latent"], 2)
    q_latent = proj("kv_b_k", "bsad,cad->bsac", q_nope, [KL, heads, DN], ["kv_lora", "heads", "nope_dim"])
    query = g.concat(f"{p}.attn.query", [q_latent, q_rope], [B, S, 1, heads, KL + DR],
                     ["batch", "seq", "latent_heads", "heads", "latent"], 4)
    cache = g.input(f"{p}.attn.latent_cache", [B, kv_tokens, 1, KL + DR], ["batch", "kv_tokens", "latent_heads", "latent"],
                    cache_dtype)
    context = g.attention(f"{p}.attn.core", query, (entry,), (cache,), pairs, out_dim=KL, out_axis="kv_lora")
    v = proj("kv_b_v", "bsnac,cav->bsav", context, [KL, heads, DV], ["kv_lora", "heads", "v_dim"])
    out = proj("out.matmul", "bsav,avh->bsh", v, [heads, DV, hidden], ["heads", "v_dim", "embed"])
    return g.constrain(f"{p}.attn.out", out, "residual")
