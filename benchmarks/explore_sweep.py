"""Does `stg explore` estimate a plan as its written set replays? Plans explore shortens.

    python benchmarks/explore_sweep.py [--network NAME] [--only SUBSTRING]

Explore times a long pipeline from shorter ones (stg/explore/probe.py: two probes of fewer
micro-batches, or four folded pipelines of fewer stages, extended linearly or bilinearly) and
every plan from programs lowered for timing only. The written set is what `stg generate`
writes, replayed whole. For each plan below, the estimate that explore ranks
(stg.explore.search.evaluate) and the written set's (stg.explore.cost.estimate of
stg.api.build: the programs `stg generate` writes, replayed whole; tests/test_explore.py checks
that `stg validate --timed alpha-beta --network` of the written files agrees) must agree: the step
within 2 % (issue 13's criterion), the peak memory and the model FLOPs exactly. Prints one line
per plan (its error, whether it was probed or folded, both costs in seconds) and exits 1 if any
plan is off. timing_sweep.py checks the timing-only lowering with the whole pipeline; this
checks what the shortening adds, on plans of the size it is used for: 30 plans, 87 s on the
2-core machine (2026-12-03: all within 0.07 %, memory and FLOPs equal; 18 probed, 5 folded).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from model_zoo import load_model
from stg.api import build
from stg.errors import StgError
from stg.explore.cost import estimate
from stg.explore.network import load_network
from stg.explore.probe import may_fold, probe_counts
from stg.explore.search import evaluate
from stg.plan import Plan

TOLERANCE = 0.02

# (model, plan): micro-batch counts past probe_counts' 12 pp (8 pp interleaved), or cuts with
# alike middle stages that may_fold folds; every schedule, ZeRO 0-3, recomputation, sp on and
# off, cp, ep, a tied model from a HuggingFace config, recommendation models and a model
# described in YAML
QWEN2_05B = {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
             "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True}
PLANS = [
    ("llama3-8b", dict(dp=8, micro_batch=1, global_batch=8 * 16, seq=4096)),
    ("llama3-8b", dict(dp=4, tp=2, cp=2, micro_batch=1, global_batch=4 * 16, seq=8192, zero=3, recompute="full")),
    ("llama3-8b", dict(dp=4, tp=2, sp=False, pp=2, micro_batch=1, global_batch=4 * 32, seq=4096, zero=1)),
    ("llama3-8b", dict(dp=2, tp=2, pp=4, vpp=2, schedule="interleaved", micro_batch=1, global_batch=2 * 40,
                       seq=4096, zero=1, recompute="selective")),
    ("llama3-8b", dict(dp=2, pp=4, schedule="zb-h1", micro_batch=1, global_batch=2 * 52, seq=2048, zero=0)),
    ("llama3-8b", dict(dp=2, pp=2, schedule="gpipe", micro_batch=2, global_batch=2 * 2 * 32, seq=2048, zero=2)),
    ("llama3-70b", dict(dp=2, tp=8, pp=2, micro_batch=1, global_batch=2 * 32, seq=4096, zero=1,
                        recompute="selective")),
    ("llama3-70b", dict(dp=1, tp=8, pp=16, micro_batch=1, global_batch=32, seq=4096, zero=1)),
    ("llama3-70b", dict(dp=1, tp=8, pp=16, schedule="zb-h1", micro_batch=1, global_batch=256, seq=4096, zero=1)),
    ("llama3-70b", dict(dp=2, tp=8, pp=16, schedule="gpipe", micro_batch=1, global_batch=2 * 64, seq=4096, zero=1,
                        recompute="full")),
    ("llama3-70b", dict(dp=2, tp=4, cp=2, pp=8, vpp=2, schedule="interleaved", micro_batch=1, global_batch=2 * 80,
                        seq=8192, zero=1, recompute="full")),
    ("llama2-70b", dict(dp=2, tp=8, pp=4, micro_batch=1, global_batch=2 * 64, seq=4096, zero=1)),
    ("gpt3-175b", dict(dp=1, tp=8, pp=12, micro_batch=1, global_batch=36, seq=2048, zero=1, recompute="selective",
                       layers_per_stage="auto")),
    ("gpt3-175b", dict(dp=1, tp=8, pp=8, micro_batch=1, global_batch=8 * 14, seq=2048, zero=0, sp=False)),
    ("gpt3-175b", dict(dp=1, tp=8, pp=16, vpp=2, schedule="interleaved", micro_batch=1, global_batch=96, seq=2048,
                       zero=1)),
    ("megatron-1t", dict(dp=1, tp=8, pp=16, micro_batch=1, global_batch=64, seq=2048, zero=1)),
    ("megatron-1t", dict(dp=2, tp=8, pp=16, vpp=2, schedule="interleaved", micro_batch=1, global_batch=2 * 192,
                         seq=2048, zero=1)),
    ("llama3-405b", dict(dp=1, tp=8, pp=16, micro_batch=1, global_batch=64, seq=8192, zero=1,
                         layers_per_stage="auto")),
    ("mixtral-8x7b", dict(dp=4, ep=4, tp=2, pp=2, micro_batch=1, global_batch=4 * 26, seq=4096, zero=1)),
    ("mixtral-8x7b", dict(dp=8, ep=8, micro_batch=1, global_batch=8 * 16, seq=4096, zero=1, recompute="full",
                          expert_skew=1.5)),
    ("mixtral-8x22b", dict(dp=8, ep=8, tp=2, pp=8, micro_batch=1, global_batch=8 * 16, seq=4096, zero=1,
                           layers_per_stage="auto")),
    ("deepseek-v3", dict(dp=8, ep=8, pp=8, micro_batch=1, global_batch=8 * 16, seq=4096, zero=1,
                         layers_per_stage="auto")),
    ("deepseek-v3", dict(dp=8, ep=8, pp=16, micro_batch=1, global_batch=8 * 64, seq=4096, zero=1,
                         layers_per_stage="auto", schedule="zb-h1")),
    ("mixtral-8x7b", dict(dp=4, ep=4, cp=2, pp=2, vpp=2, schedule="interleaved", micro_batch=1, global_batch=4 * 20,
                          seq=8192, zero=1)),
    (QWEN2_05B, dict(dp=2, tp=2, pp=4, micro_batch=1, global_batch=2 * 52, seq=4096, zero=1)),
    (QWEN2_05B, dict(dp=2, tp=2, pp=8, micro_batch=1, global_batch=2 * 64, seq=4096, zero=1)),
    ("dlrm-kaggle", dict(dp=16, micro_batch=256, global_batch=16 * 256 * 16, embedding_sharding="table_wise")),
    ("dlrm-kaggle", dict(dp=16, micro_batch=256, global_batch=16 * 256 * 16, embedding_sharding="row_wise")),
    ("dlrm-dcnv2", dict(dp=16, micro_batch=256, global_batch=16 * 256 * 13, embedding_sharding="auto")),
    ("examples/tiny-gpt.yaml", dict(dp=2, tp=2, pp=2, micro_batch=1, global_batch=2 * 30, seq=512, zero=1)),
]


def _model(source: str | dict):
    """A zoo name or YAML path, or a HuggingFace config (written out, read as a user's would be)."""
    if isinstance(source, str):
        return load_model(source)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "config.json"
        path.write_text(json.dumps(source))
        return load_model(str(path))


def main(network_name: str, only: str | None) -> int:
    network = load_network(network_name)
    checked, off, started = 0, 0, time.perf_counter()
    for source, fields in PLANS:
        name = source if isinstance(source, str) else f"{source['model_type']} (HuggingFace config)"
        if only and only not in name:
            continue
        model, plan = _model(source), Plan.from_dict(fields)
        try:
            began = time.perf_counter()
            explored = evaluate(model, plan, network, 1 << 62)
            explore_s, began = time.perf_counter() - began, time.perf_counter()
            written = estimate(build(model, plan), network)
            written_s = time.perf_counter() - began
        except StgError as error:
            print(f"REFUSED {name} {fields}: {error}", flush=True)
            off += 1
            continue
        checked += 1
        error = explored.step_us / written.step_us - 1
        shortened = "folded" if may_fold(plan) else f"probed {probe_counts(plan)}" if probe_counts(plan) else "whole"
        bad = (abs(error) > TOLERANCE or explored.peak_memory != written.peak_memory
               or explored.model_flops != written.model_flops)
        off += bad
        print(f"{'OFF ' if bad else ''}{name} {fields}: {shortened}, step {explored.step_us / 1e3:,.1f} ms against "
              f"{written.step_us / 1e3:,.1f} ms ({error:+.3%}), memory "
              f"{'equal' if explored.peak_memory == written.peak_memory else 'DIFFERS'}, flops "
              f"{'equal' if explored.model_flops == written.model_flops else 'DIFFER'} "
              f"[{explore_s:.1f} s against {written_s:.1f} s]", flush=True)
    print(f"{checked} plans estimated and written, {off} off ({time.perf_counter() - started:.0f} s)")
    return 1 if off else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--network", default="dgx-h100-superpod")
    parser.add_argument("--only", help="only the models whose name holds this")
    args = parser.parse_args()
    sys.exit(main(args.network, args.only))
