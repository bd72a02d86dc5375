"""Continuous-batching schedulers: requests in, a sequence of iterations out.

Pure bookkeeping, no time: a closed batch (every request waiting at the start) gives the same
iterations whatever the iterations cost. Time enters only through `arrived`, the requests a
caller releases before each iteration (stg/serve/run.py advances a clock with the cost model).

Paged KV cache (vLLM): `num_blocks` blocks of `block_size` tokens. A request whose cache holds n
tokens holds ceil(n / block_size) blocks. Request i's prompt is P_i tokens, it yields O_i tokens:
its prefill (possibly in chunks) processes the P_i prompt tokens and the last chunk samples token
1; each decode processes the previous token (q = 1) and samples the next, O_i - 1 decodes in all.

`sarathi` (Sarathi-Serve's chunked prefill; what Vidur calls "sarathi"), per iteration:
  1. a token budget of max_num_batched_tokens, at most max_num_seqs requests;
  2. running requests whose prompt is done decode first, in admission order, one token each; a
     decode whose token crosses a block boundary takes one more block; when none is free the
     most recently admitted running request is preempted by recompute (its blocks freed, it goes
     back to the front of the queue; it later re-prefills its prompt and every token it has
     generated, as vLLM's recompute does, which samples its next token), repeated until the
     block is found or the decode itself was the one preempted;
  3. then running requests with part of their prompt left, in admission order, each
     min(remaining prompt, remaining budget) tokens (their blocks were taken at admission);
  4. then waiting requests in arrival order (preempted ones first), each admitted only if the
     blocks of its whole prompt leave at least the watermark (int(watermark x num_blocks),
     vLLM's rule) free; admission stops at the first that does not fit (no skipping), at an
     empty budget, or at max_num_seqs; an admitted request takes min(prompt, budget) tokens.
  Requests that sampled their last token leave after the iteration and free their blocks.

Speculative decoding (`speculative` K > 0, both policies): a decode verifies K draft tokens,
q = K + 1 tokens of budget and blocks for cache + K + 1 tokens; it keeps floor((s+1)E) -
floor(sE) tokens at its s-th verification, E = (1 - a^(K+1)) / (1 - a) the expected tokens per
verification at acceptance rate a (Leviathan et al. 2023), so its cache grows by that much.

`vllm` (vLLM v1's scheduler with chunked prefill), where it differs from sarathi:
  - running requests are served in admission order whatever their phase (a prefill chunk and
    decodes mixed), each min(tokens left to compute, budget);
  - blocks are allocated for the tokens scheduled in this iteration only (v1's allocate_slots),
    at admission too, and there is no watermark;
  - when blocks run short the most recently admitted running request is preempted (as above);
  - waiting requests are considered only if nothing was preempted in this iteration.
"""

from __future__ import annotations

from collections import deque
from fractions import Fraction
from math import floor
from dataclasses import dataclass, field
from enum import Enum
from typing import Iterable

from stg.errors import PlanError


class Policy(Enum):
    SARATHI = "sarathi"
    VLLM = "vllm"


@dataclass(frozen=True)
class Request:
    id: int
    arrival_s: float
    prompt: int  # prompt tokens
    output: int  # tokens to generate (>= 1)
    # a decode instance's request (disaggregated serving): its prompt's KV cache arrives with it
    # and its first token is out; admitted with blocks for prompt + 1 tokens, it decodes at once
    prefilled: bool = False


@dataclass(frozen=True)
class SchedulerConfig:
    policy: Policy = Policy.SARATHI
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 256
    block_size: int = 16
    num_blocks: int = 1024
    watermark: float = 0.01  # sarathi only
    # speculative decoding: each decode verifies `speculative` draft tokens (q = K + 1) and
    # keeps the expected number of tokens (expected_tokens) per verification
    speculative: int = 0
    acceptance_rate: float = 0.0

    @property
    def expected_tokens(self) -> Fraction:
        """Tokens a verification step yields on average, (1 - a^(K+1)) / (1 - a) for acceptance
        rate a of each draft token, independently (Leviathan et al. 2023, eq. 1): K + 1 at a = 1."""
        k, a = self.speculative, Fraction(str(self.acceptance_rate))
        return Fraction(k + 1) if a == 1 else (1 - a ** (k + 1)) / (1 - a)

    @property
    def watermark_blocks(self) -> int:
        return int(self.watermark * self.num_blocks) if self.policy is Policy.SARATHI else 0


@dataclass(frozen=True)
class Slot:
    """One request's share of an iteration: q new tokens on top of c cached ones."""

    request: int
    q: int
    c: int
    samples: bool  # this iteration yields one of its tokens (a decode, or its prompt's last chunk)
    decode: bool = False  # a decode (under speculative decoding: a verification of q - 1 draft tokens)


@dataclass(frozen=True)
class Iteration:
    index: int
    slots: tuple[Slot, ...]
    blocks_used: int  # after the iteration's allocations, before finished requests free theirs
    preempted: tuple[int, ...] = ()
    finished: tuple[int, ...] = ()

    @property
    def tokens(self) -> int:
        return sum(s.q for s in self.slots)

    def to_dict(self) -> dict:
        return {"iteration": self.index, "requests": [[s.request, s.q, s.c] for s in self.slots],
                "tokens": self.tokens, "blocks_used": self.blocks_used,
                "preempted": list(self.preempted), "finished": list(self.finished)}


@dataclass
class _Live:
    """A request's mutable progress inside the scheduler."""

    request: Request
    target: int  # tokens its prefill processes: the prompt, or prompt + generated after a preemption
    computed: int = 0  # tokens in its cache
    generated: int = 0
    blocks: int = 0
    decoding: bool = False  # its prefill is done
    verified: int = 0  # speculative verifications so far

    @property
    def prefilling(self) -> bool:
        return not self.decoding


@dataclass
class Scheduler:
    config: SchedulerConfig
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)
    free: int = 0
    iterations: int = 0

    def __post_init__(self):
        c = self.config
        for name in ("max_num_batched_tokens", "max_num_seqs", "block_size", "num_blocks"):
            if not isinstance(getattr(c, name), int) or getattr(c, name) <= 0:
                raise PlanError(f"{name}: must be a positive integer, got {getattr(c, name)!r}")
        if not isinstance(c.speculative, int) or c.speculative < 0 or c.speculative + 1 > c.max_num_batched_tokens:
            raise PlanError(f"speculative: must be 0 or a number of draft tokens below max_num_batched_tokens, "
                            f"got {c.speculative!r}")
        if isinstance(c.acceptance_rate, bool) or not isinstance(c.acceptance_rate, (int, float)) \
                or not 0 <= c.acceptance_rate <= 1:
            raise PlanError(f"acceptance_rate: must be in [0, 1], got {c.acceptance_rate!r}")
        self.free = c.num_blocks

    def arrive(self, requests: Iterable[Request]) -> None:
        for request in requests:
            if request.prompt <= 0 or request.output <= 0:
                raise PlanError(f"request {request.id}: prompt and output tokens must be positive, "
                                f"got {request.prompt} and {request.output}")
            # its longest cache: every token but the last, plus a verification's draft tokens
            need = -(-(request.prompt + request.output - 1 + self.config.speculative) // self.config.block_size)
            if need > self.config.num_blocks - self.config.watermark_blocks:
                raise PlanError(f"request {request.id}: needs {need} KV blocks, more than the "
                                f"{self.config.num_blocks} the cache has (num_kv_blocks)")
            live = _Live(request, request.prompt)
            if request.prefilled:
                live.computed, live.generated, live.decoding = request.prompt, 1, True
            self.waiting.append(live)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.config.block_size)

    def _preempt_last(self, preempted: list[int]) -> _Live:
        victim = self.running.pop()  # the most recently admitted
        self.free += victim.blocks
        victim.blocks, victim.computed, victim.decoding = 0, 0, False
        victim.target = victim.request.prompt + victim.generated
        self.waiting.appendleft(victim)
        preempted.append(victim.request.id)
        return victim

    def _grow(self, live: _Live, tokens: int, preempted: list[int]) -> bool:
        """Blocks for `live` to hold `tokens`, preempting from the back; False if it was preempted."""
        need = self._blocks_for(tokens) - live.blocks
        while need > self.free:
            if self._preempt_last(preempted) is live:
                return False
        self.free -= max(0, need)
        live.blocks += max(0, need)
        return True

    def _accepted(self, live: _Live) -> int:
        """Tokens this decode yields: 1, or under speculation the s-th verification's share of
        the expectation, floor((s + 1) E) - floor(s E) (deterministic; averages E)."""
        if not self.config.speculative:
            return 1
        expected, s = self.config.expected_tokens, live.verified
        live.verified += 1
        return floor((s + 1) * expected) - floor(s * expected)

    def step(self) -> Iteration | None:
        """The next iteration, or None when nothing is waiting or running."""
        iteration = self._step()
        if iteration is None and (self.running or self.waiting):
            # a vllm iteration that preempted every running request and so admitted none
            iteration = self._step()
            if iteration is None:
                raise PlanError("scheduler: no waiting request fits an empty iteration (max_num_batched_tokens, "
                                "max_num_seqs, num_kv_blocks)")
        return iteration

    def _step(self) -> Iteration | None:
        c = self.config
        budget, slots, preempted = c.max_num_batched_tokens, [], []
        chosen: list[tuple[_Live, int]] = []
        sarathi = c.policy is Policy.SARATHI
        # running requests: sarathi takes the decodes first, then the prompt chunks; vllm takes them as they stand
        order = ([r for r in self.running if not r.prefilling] + [r for r in self.running if r.prefilling]
                 if sarathi else list(self.running))
        for live in order:
            if live not in self.running or budget == 0 or len(chosen) == c.max_num_seqs:
                continue
            q = min(live.target - live.computed, budget) if live.prefilling else c.speculative + 1
            if q > budget:
                continue
            if (not live.prefilling or not sarathi) and not self._grow(live, live.computed + q, preempted):
                continue
            chosen.append((live, q))
            budget -= q
        if sarathi or not preempted:
            while self.waiting and budget > 0 and len(chosen) < c.max_num_seqs:
                live = self.waiting[0]
                q = c.speculative + 1 if live.decoding else min(live.target, budget)
                if q > budget:
                    break
                need = self._blocks_for(live.computed + q if live.decoding else live.target if sarathi else q)
                if self.free - need < c.watermark_blocks:
                    break
                self.waiting.popleft()
                self.free -= need
                live.blocks = need
                self.running.append(live)
                chosen.append((live, q))
                budget -= q
        # victims are the most recently admitted, served after everything chosen before them
        assert all(live in self.running for live, _ in chosen)
        if not chosen:
            return None
        finished = []
        for live, q in chosen:
            samples = live.decoding or live.computed + q == live.target
            slots.append(Slot(live.request.id, q, live.computed, samples, live.decoding))
            tokens = self._accepted(live) if live.decoding else int(samples)
            live.computed += tokens if live.decoding else q  # a verification keeps the accepted tokens' cache
            live.decoding = live.decoding or samples
            live.generated += min(tokens, live.request.output - live.generated)
            if live.generated == live.request.output:
                finished.append(live)
        used = c.num_blocks - self.free
        for live in finished:
            self.running.remove(live)
            self.free += live.blocks
        iteration = Iteration(self.iterations, tuple(slots), used, tuple(preempted),
                              tuple(live.request.id for live in finished))
        self.iterations += 1
        return iteration
