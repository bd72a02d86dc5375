"""`stg serve`: the serving modes on the command line (flags in vLLM's vocabulary)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def serve(
    model: str = typer.Argument(..., help="A zoo name (see `stg models`), a model YAML or a HuggingFace config.json (gpt, llama, mixtral, deepseek families)."),
    out: Path = typer.Option(..., "--out", "-o", help="Output directory (replaced atomically if it holds an earlier trace set)."),
    mode: str = typer.Option("serve", help="prefill (one step of --batch prompts of --prompt tokens), decode (--steps decode steps of --batch requests from --context cached tokens, growing by one a step) or serve (a --requests trace through the scheduler)."),
    requests: Optional[Path] = typer.Option(None, help="Request trace, .jsonl or .csv: Azure (TIMESTAMP, ContextTokens, GeneratedTokens) or Mooncake (timestamp in ms, input_length, output_length)."),
    batch: int = typer.Option(1, help="prefill/decode: requests in the batch."),
    prompt: int = typer.Option(1024, help="prefill: prompt tokens per request."),
    context: int = typer.Option(1024, help="decode: cached tokens per request at the first step."),
    steps: int = typer.Option(1, help="decode: decode steps."),
    tp: int = typer.Option(1, help="Tensor-parallel degree (heads, KV heads, MLP, vocabulary): an all-reduce after attention and after the MLP of every layer."),
    pp: int = typer.Option(1, help="Pipeline stages: a send/recv of the activations per iteration between stages."),
    ep: int = typer.Option(1, help="MoE: engines that step together, each with its own requests, routed experts split over them (dispatch/combine all-to-alls)."),
    dp: int = typer.Option(1, help="Independent replicas; requests are assigned round-robin in arrival order."),
    dtype: str = typer.Option("bf16", help="Weights: bf16 or fp8."),
    kv_cache_dtype: str = typer.Option("bf16", "--kv-cache-dtype", help="KV cache: bf16 or fp8."),
    device: str = typer.Option("h100", help="Device for the roofline durations (on h100 and h200 each GEMM at the fraction of peak measured for its size) and memory: h100, h200, a100, b200, mi300x."),
    attention_flops: str = typer.Option("causal", help="Count attention's query-key pairs as causal (skip masked) or full (whole squares, as FlopCounterMode)."),
    scheduler: str = typer.Option("sarathi", help="sarathi (chunked prefill, decodes first, whole-prompt admission above a 1% watermark) or vllm (vLLM v1)."),
    max_num_batched_tokens: int = typer.Option(512, "--max-num-batched-tokens", help="Token budget of an iteration."),
    max_num_seqs: int = typer.Option(256, "--max-num-seqs", help="Requests per iteration at most."),
    block_size: int = typer.Option(16, "--block-size", help="Tokens per KV-cache block."),
    gpu_memory_utilization: float = typer.Option(0.9, "--gpu-memory-utilization", help="Share of device memory for weights, activations and the KV cache."),
    num_kv_blocks: Optional[int] = typer.Option(None, "--num-kv-blocks", help="KV-cache blocks per rank, overriding the planner."),
    prefill_instances: int = typer.Option(0, "--prefill-instances", help="Disaggregated serving: prefill instances (each --prefill-tp x --prefill-pp, x --ep); requests' KV caches move to --decode-instances as send/recv pairs per layer."),
    decode_instances: int = typer.Option(0, "--decode-instances", help="Disaggregated serving: decode instances (each --decode-tp x --decode-pp, x --ep)."),
    prefill_tp: Optional[int] = typer.Option(None, "--prefill-tp", help="Disaggregated serving: tp of each prefill instance [default: --tp]; KV caches move between overlapping KV-head ranges."),
    prefill_pp: Optional[int] = typer.Option(None, "--prefill-pp", help="Disaggregated serving: pp of each prefill instance [default: --pp]."),
    decode_tp: Optional[int] = typer.Option(None, "--decode-tp", help="Disaggregated serving: tp of each decode instance [default: --tp]."),
    decode_pp: Optional[int] = typer.Option(None, "--decode-pp", help="Disaggregated serving: pp of each decode instance [default: --pp]."),
    sp: bool = typer.Option(False, "--sp", help="Sequence parallelism (needs tp > 1): each tp all-reduce becomes a reduce-scatter, the norms run on the step's tokens split over tp, and an all-gather before the next block (Megatron's); a step's tokens are padded to a multiple of tp."),
    speculative: int = typer.Option(0, "--speculative", help="Speculative decoding: draft tokens K per decode (needs --draft)."),
    draft: Optional[str] = typer.Option(None, "--draft", help="Draft model for --speculative: a zoo name or model file (same tp)."),
    acceptance_rate: float = typer.Option(0.7, "--acceptance-rate", help="Probability that each draft token is accepted; a verification yields (1 - a^(K+1)) / (1 - a) tokens on average."),
    slo_ttft_ms: Optional[float] = typer.Option(None, "--slo-ttft-ms", help="serve: TTFT target for goodput."),
    slo_tpot_ms: Optional[float] = typer.Option(None, "--slo-tpot-ms", help="serve: TPOT target for goodput."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No summary line."),
):
    """Write the trace set of an inference workload: OUT/workload.<rank>.et, workload.json and summary.json (iterations, KV-cache pool, per-request TTFT/TPOT/latency)."""
    from stg.cli import _user_errors, err
    from stg.serve import ServePlan, generate_serving

    with _user_errors():
        plan = ServePlan(tp=tp, pp=pp, ep=ep, dp=dp, dtype=dtype, kv_cache_dtype=kv_cache_dtype, device=device,
                         attention_flops=attention_flops, scheduler=scheduler,
                         max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                         block_size=block_size, gpu_memory_utilization=gpu_memory_utilization,
                         num_kv_blocks=num_kv_blocks, prefill_instances=prefill_instances,
                         decode_instances=decode_instances, prefill_tp=prefill_tp, prefill_pp=prefill_pp,
                         decode_tp=decode_tp, decode_pp=decode_pp, sp=sp, speculative=speculative, draft=draft,
                         acceptance_rate=acceptance_rate)
        summary = generate_serving(model, plan, out, mode=mode, batch=batch, prompt=prompt, context=context,
                                   steps=steps, requests=requests, slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms)
    if not quiet:
        kv = summary["kv_cache"]
        iterations = sum(len(r["iterations"]) for r in summary.get("replicas", summary.get("instances", [])))
        line = (f"{summary['world_size']} ranks, {iterations} iterations, KV cache {kv['blocks']:,} blocks "
                f"({kv['tokens']:,} tokens) per rank")
        if "totals" in summary:
            t = summary["totals"]
            line += (f"; {t['requests']} requests in {t['makespan_s']:.2f} s, "
                     f"{t['throughput_tokens_per_s']:,.0f} tokens/s, TTFT p50 {t['ttft_s']['p50'] * 1e3:.1f} ms")
        err.print(f"{line} -> {out}", highlight=False, soft_wrap=True)
