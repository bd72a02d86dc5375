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
"""

from __future__ import annotations

from typing import Mapping

from stg.plan import Plan
from stg.sharding import LayoutRules


def layouts(plan: Plan, params: Mapping[str, tuple[str, ...]], in_play: tuple[str, ...]) -> dict:
    # the data-parallel axes; an expert's weights are split on ep already, so their flat
    # shards span dp (and cp) only: the expert-data-parallel group
    axes = tuple(a for a in ("dp", "ep", "cp", "local") if a in in_play)
    return {
        "params": LayoutRules(params, axes if plan.zero >= 3 else ()),
        "states": LayoutRules(params, axes if plan.zero >= 1 else ()),
        # CONSTRAIN anchors: gradients as stored, and parameters as stored after the step
        "grad": LayoutRules(params, axes) if plan.zero >= 2 else None,
        "param": LayoutRules(params, axes if plan.zero >= 3 else ()),
    }
