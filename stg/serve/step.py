"""One inference step's shape: the (q, c) of each request in it, bound to the graph's symbols.

The step graph (model_zoo/transformer.py with a KV cache) is sized by four symbols per engine
(B engines step together: 1, or the expert-parallel ranks); a batch of requests, request i with
q_i new tokens on top of c_i cached ones, binds them:

  S        = sum q_i                      tokens run through every linear layer
  Tkv      = sum (c_i + q_i)              keys and values read from the cache (after the append)
  Pqk      = sum q_i (c_i + q_i)          query-key pairs scored, counting full squares
             (--attention-flops full, what FlopCounterMode counts for HuggingFace's code), or
           = sum q_i c_i + q_i (q_i + 1)/2  with the causal mask's skipped pairs left out (causal)
  Nout     = requests that sample a token (a decode, or the chunk that ends a prompt): the
             LM head runs on those positions only, as vLLM and HF generate() do; a speculative
             verification of K draft tokens samples all its K + 1 positions
"""

from __future__ import annotations

from dataclasses import dataclass

from stg.plan import AttentionFlops
from stg.serve.scheduler import Slot
from stg.symbols import KV_TOKENS, PAIRS, SAMPLED, S


@dataclass(frozen=True)
class StepShape:
    tokens: int
    kv_tokens: int
    pairs: int
    sampled: int

    @classmethod
    def of(cls, slots: tuple[Slot, ...], attention: AttentionFlops) -> "StepShape":
        full = attention is AttentionFlops.FULL
        pairs = sum(s.q * (s.c + s.q) if full else s.q * s.c + s.q * (s.q + 1) // 2 for s in slots)
        # a speculative verification (a decode of q > 1) needs the logits of all its q positions
        sampled = sum(s.q if s.decode else int(s.samples) for s in slots)
        return cls(sum(s.q for s in slots), sum(s.c + s.q for s in slots), pairs, sampled)

    def bindings(self) -> dict:
        """The step symbols of one engine's step (B, the engines stepping together, is the plan's)."""
        return {S: self.tokens, KV_TOKENS: self.kv_tokens, PAIRS: self.pairs, SAMPLED: self.sampled}

    @classmethod
    def widest(cls, shapes) -> "StepShape":
        """What engines stepping together (expert parallelism) each run: every size padded to the largest."""
        shapes = list(shapes)
        return cls(*(max(getattr(s, f) for s in shapes) for f in ("tokens", "kv_tokens", "pairs", "sampled")))

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "kv_tokens": self.kv_tokens, "pairs": self.pairs, "sampled": self.sampled}


def uniform(batch: int, q: int, c: int, first: int = 0) -> tuple[Slot, ...]:
    """`batch` requests (ids from `first`) each running q new tokens on c cached ones, each
    sampling one token."""
    return tuple(Slot(first + i, q, c, True, decode=q == 1 and c > 0) for i in range(batch))
