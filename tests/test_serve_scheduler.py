"""The continuous-batching schedulers, iteration by iteration, against hand traces of the
rules in stg/serve/scheduler.py (Sarathi-Serve's chunked prefill; vLLM v1's scheduler)."""

from fractions import Fraction

import pytest

from stg.errors import PlanError
from stg.serve.scheduler import Policy, Request, Scheduler, SchedulerConfig


def run(config, requests):
    scheduler = Scheduler(config)
    scheduler.arrive(requests)
    out = []
    while (iteration := scheduler.step()) is not None:
        out.append(iteration)
    assert scheduler.idle
    return out


def table(iterations):
    return [([(s.request, s.q, s.c) for s in it.slots], it.blocks_used, list(it.preempted), list(it.finished))
            for it in iterations]


# Budget 8 tokens, 4 seqs, blocks of 4 tokens, 10 blocks, watermark 10 % = 1 block.
CHUNKED = SchedulerConfig(Policy.SARATHI, max_num_batched_tokens=8, max_num_seqs=4, block_size=4, num_blocks=10,
                          watermark=0.1)
CHUNKED_REQUESTS = [Request(0, 0, 10, 2), Request(1, 0, 6, 3), Request(2, 0, 20, 1), Request(3, 0, 3, 2)]


def test_sarathi_chunks_prompts_decodes_first_and_stops_at_the_watermark():
    # Worked by hand from the rules:
    # it0: r0 admitted (3 blocks, 7 free >= 1), takes min(10, 8) = 8 tokens; budget spent.
    # it1: r0's last 2 prompt tokens (samples token 1); r1 admitted (2 blocks), takes 6.
    # it2: decodes r0 (c=10 -> 11 tokens, 3 blocks hold 12), r1 (c=6); r2 needs 5 blocks of the
    #      5 free, leaving 0 < 1 (watermark): admission stops. r0 has its 2 tokens: leaves.
    # it3: decode r1 (c=7, its 3rd token: leaves); r2 admitted (8 free - 5 >= 1), takes 7.
    # it4: r2's chunk min(13, 8) = 8; no budget for r3.
    # it5: r2's last 5 tokens (its only token: leaves); r3 admitted, 3 tokens.
    # it6: decode r3 (c=3 -> 4 tokens, still 1 block).
    assert table(run(CHUNKED, CHUNKED_REQUESTS)) == [
        ([(0, 8, 0)], 3, [], []),
        ([(0, 2, 8), (1, 6, 0)], 5, [], []),
        ([(0, 1, 10), (1, 1, 6)], 5, [], [0]),
        ([(1, 1, 7), (2, 7, 0)], 7, [], [1]),
        ([(2, 8, 7)], 5, [], []),
        ([(2, 5, 15), (3, 3, 0)], 6, [], [2]),
        ([(3, 1, 3)], 1, [], [3]),
    ]


def test_sarathi_preempts_the_most_recent_request_which_later_recomputes():
    # Blocks of 2 tokens, 4 blocks, no watermark; two requests of prompt 3, output 4.
    # it0: both admitted (2 blocks each), both prompts whole (each samples token 1).
    # it1: both decode (c=3 -> 4 tokens fit in 2 blocks).
    # it2: r0 decodes c=4 -> 5 tokens: a 3rd block, none free: r1 (most recent) preempted, its
    #      2 blocks freed; r1 must re-prefill 3 + 2 = 5 tokens (3 blocks), 1 free: not admitted.
    # it3: r0 decodes its 4th token and leaves (3 blocks freed: 4 free).
    # it4: r1 re-admitted: 5 tokens at once (samples its 3rd token).
    # it5: r1 decodes c=5 (3 blocks hold 6), its 4th token.
    config = SchedulerConfig(Policy.SARATHI, max_num_batched_tokens=16, max_num_seqs=8, block_size=2, num_blocks=4,
                             watermark=0.0)
    assert table(run(config, [Request(0, 0, 3, 4), Request(1, 0, 3, 4)])) == [
        ([(0, 3, 0), (1, 3, 0)], 4, [], []),
        ([(0, 1, 3), (1, 1, 3)], 4, [], []),
        ([(0, 1, 4)], 3, [1], []),
        ([(0, 1, 5)], 3, [], [0]),
        ([(1, 5, 0)], 3, [], []),
        ([(1, 1, 5)], 3, [], [1]),
    ]


def test_vllm_allocates_only_the_scheduled_chunk_and_admits_without_watermark():
    # Same requests as the chunked case; it0 and it1 as sarathi (r0's second chunk takes a 3rd
    # block then). it2: r0 and r1 decode; r2 needs blocks only for its 6-token chunk (2 of the
    # 5 free) and is admitted, where sarathi waited for its whole prompt's 5 blocks.
    config = SchedulerConfig(Policy.VLLM, max_num_batched_tokens=8, max_num_seqs=4, block_size=4, num_blocks=10)
    assert table(run(config, CHUNKED_REQUESTS))[:3] == [
        ([(0, 8, 0)], 2, [], []),
        ([(0, 2, 8), (1, 6, 0)], 5, [], []),
        ([(0, 1, 10), (1, 1, 6), (2, 6, 0)], 7, [], [0]),
    ]


def test_vllm_admits_nothing_in_an_iteration_that_preempted():
    config = SchedulerConfig(Policy.VLLM, max_num_batched_tokens=16, max_num_seqs=8, block_size=2, num_blocks=4)
    iterations = run(config, [Request(0, 0, 3, 4), Request(1, 0, 3, 4), Request(2, 0, 1, 1)])
    preempting = [it for it in iterations if it.preempted]
    assert preempting and all(s.request == 0 for it in preempting for s in it.slots)


def test_max_num_seqs_caps_the_batch():
    config = SchedulerConfig(Policy.SARATHI, max_num_batched_tokens=100, max_num_seqs=2, block_size=16, num_blocks=100)
    first = run(config, [Request(i, 0, 4, 2) for i in range(3)])[0]
    assert [s.request for s in first.slots] == [0, 1]


def test_a_request_larger_than_the_cache_is_refused():
    with pytest.raises(PlanError, match="request 0: needs 3 KV blocks"):
        Scheduler(SchedulerConfig(num_blocks=2, block_size=4, watermark=0.0)).arrive([Request(0, 0, 8, 3)])


def test_speculative_decoding_keeps_the_expected_tokens_per_verification():
    # K = 3 draft tokens accepted with probability 1/2 each: a verification yields
    # (1 - 0.5^4) / (1 - 0.5) = 15/8 tokens on average (Leviathan et al. 2023, eq. 1); the s-th
    # keeps floor((s+1) 15/8) - floor(s 15/8): 1, 2, 2, 2, ...
    config = SchedulerConfig(Policy.SARATHI, max_num_batched_tokens=16, max_num_seqs=4, block_size=4, num_blocks=10,
                             watermark=0.0, speculative=3, acceptance_rate=0.5)
    assert config.expected_tokens == Fraction(15, 8)
    # prompt 4, output 6: the prefill samples token 1; verifications of 4 tokens on 4, 5, 7 cached
    # (1, 2, 2 kept: tokens 2, 3-4, 5-6); blocks for cache + 4 verified tokens: 8, 9, 11 -> 2, 3, 3
    assert table(run(config, [Request(0, 0, 4, 6)])) == [
        ([(0, 4, 0)], 1, [], []),
        ([(0, 4, 4)], 2, [], []),
        ([(0, 4, 5)], 3, [], []),
        ([(0, 4, 7)], 3, [], [0]),
    ]
