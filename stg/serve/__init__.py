"""Inference and serving workloads (DESIGN.md's stg/serve room).

    from stg.serve import ServePlan, generate_serving
    generate_serving("llama3-8b", ServePlan(tp=2), "out/", mode="decode", batch=8, context=1024, steps=16)

engine     the inference step graph laid out once, lowered per step shape (ServePlan)
step       a step's (q, c) per request bound to the graph's symbols
template   a stage's step lowered once, its numbers compiled into polynomials of the step
scheduler  continuous batching: sarathi and vllm, speculative decoding; pure bookkeeping
kvcache    KV bytes per token and the cache planner
requests   Azure and Mooncake request traces
run        the three modes (prefill, decode, serve) and time
metrics    per-request TTFT/TPOT/latency and totals
records    per-iteration records streamed to iterations.jsonl
stream     writing: every rank's steps streamed from the templates by byte patching
disagg     prefill and decode instances, KV caches moved by send/recv
instances  their ranks (each instance its own tp/pp), KV overlaps, groups
cli        `stg serve`
"""

import importlib

# names load on first use (PEP 562): the CLI registers `stg serve` without importing sympy
_HOMES = {"ServePlan": "engine", "Mode": "run", "generate_serving": "run", "Policy": "scheduler",
          "Request": "scheduler", "Scheduler": "scheduler", "SchedulerConfig": "scheduler"}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(f"stg.serve.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'stg.serve' has no attribute {name!r}")
