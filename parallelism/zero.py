"""ZeRO (Rajbhandari et al. 2019) / FSDP: model states split over the data-parallel ranks.

Splits are flat (the flattened tensor split evenly, padded), as ZeRO's and FSDP's flat
buffers are. Over the data-parallel group: dp, and cp when context parallel (Megatron's
distributed optimizer shards over dp x cp).

  stage 0: nothing split; gradients all-reduced once per step.
  stage 1: optimizer states split. Gradients accumulate whole and are reduce-scattered once
           per step; each rank updates its part; the new parameters are all-gathered
           (Megatron's distributed optimizer; the paper's P_os, 2 Psi of traffic).
  stage 2: gradients split too: reduce-scattered as each layer's backward finishes, every
           micro-batch (DeepSpeed ZeRO-2), accumulated as shards.
  stage 3: parameters split too: all-gathered before each layer's forward and again
           before its backward, freed after use (FSDP; 3 Psi of traffic).

With a pipeline (pp > 1), stages 2 and 3 store gradients and parameters as stage 1 does.
torch.distributed.pipelining runs every backward but a stage's last with FSDP's resharding and
gradient sync off (stage.py, backward_maybe_with_nosync) and TorchTitan turns
reshard_after_forward off under pp: the parameters are gathered once, kept whole through the
micro-batches, and the whole gradients reduce-scattered once after the last backward -- stage
1's traffic and peak memory (its gathers come after the optimizer, where Megatron's distributed
optimizer puts them; FSDP issues them at the next step's first forward). DeepSpeed's pipeline
engine refuses ZeRO-2/3 outright; no framework reduces per micro-batch inside a pipeline.
"""

from __future__ import annotations

from typing import Mapping

from stg.plan import Plan
from stg.sharding import LayoutRules


def layouts(plan: Plan, params: Mapping[str, tuple[str, ...]], in_play: tuple[str, ...]) -> dict:
    # the data-parallel axes; an expert's weights are split on ep already, so their flat
    # shards span dp (and cp) only: the expert-data-parallel group
    axes = tuple(a for a in ("dp", "ep", "cp", "local") if a in in_play)
    stage = min(plan.zero, 1) if "pp" in in_play else plan.zero  # a pipeline's: see above
    return {
        "params": LayoutRules(params, axes if stage >= 3 else ()),
        "states": LayoutRules(params, axes if stage >= 1 else ()),
        # CONSTRAIN anchors: gradients as stored, and parameters as stored after the step
        "grad": LayoutRules(params, axes) if stage >= 2 else None,
        "param": LayoutRules(params, axes if stage >= 3 else ()),
    }
