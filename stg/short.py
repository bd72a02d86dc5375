"""A long transformer evaluated on a short one (stg.evaluate).

A transformer's blocks are copies of one template per kind (dense, MoE), and what a block
adds to a rank's summary -- its ops' FLOPs and bytes, its collectives, its weights, gradients
and saved activations, what it sends to and receives from a neighbouring stage -- depends on
its kind and its neighbours' alone (measured on the sharded graphs: the largest distance at
which a block reads another is one block, benchmarks/layer_classes.py). So every run of more
than three blocks whose kind and both neighbours' kinds agree is cut to three -- its first,
one that stands for its middle blocks, its last -- and the symbolic passes run once on that
short model: llama3-405b's 126 blocks become 5, deepseek-v3's 61 become 8.

Each pipeline stage of the real model is then a range of the short model's blocks, each
counted as often as the real blocks it stands for (StagePlan.weights), on a stage plan of
its own whose stages before and after it hold the short model's blocks before and after
the range: the blocks at the ends of the range and their neighbours are alike to the real
ones, so what the stage receives and sends is too. Nothing in a summary names an op, so the
rows are the real model's exactly (tests/test_short.py checks them against the full passes)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

from model_zoo import Model
from model_zoo.transformer import TransformerConfig
from parallelism.pipeline import StagePlan

_KEPT = 3  # blocks a run keeps: its first, one for its middle, its last


@dataclass(frozen=True)
class ShortForm:
    """A model's short form: `image[j]` is the short block that real block j (0: the
    embedding, L + 1: the head) maps to."""

    model: Model  # the short model
    image: tuple[int, ...]
    _plans: dict = field(default_factory=dict, compare=False, repr=False)  # stage_plans's, by cut

    @cached_property
    def middles(self) -> frozenset[int]:
        """The short blocks that stand for more than one real block."""
        counts: dict[int, int] = {}
        for block in self.image:
            counts[block] = counts.get(block, 0) + 1
        return frozenset(block for block, n in counts.items() if n > 1)

    def weights(self, first: int, last: int) -> tuple[int, ...]:
        """Per short block, how many of real blocks first..last it stands for (1 outside them)."""
        weights = [1] * (self.model.layers + 2)
        for block in range(self.image[first], self.image[last] + 1):
            weights[block] = 0
        for j in range(first, last + 1):
            weights[self.image[j]] += 1
        return tuple(weights)

    def stage_plans(self, stages: StagePlan | None) -> tuple[StagePlan, ...]:
        """Per pipeline stage of `stages` (None: one stage), its stage_plan."""
        if stages not in self._plans:
            self._plans[stages] = tuple(self.stage_plan(stages, rank) for rank in range(stages.pp if stages else 1))
        return self._plans[stages]

    def stage_plan(self, stages: StagePlan | None, rank: int) -> StagePlan:
        """Pipeline stage `rank` of `stages` (None: one stage) on the short model: its real
        blocks' range, weighted, with the short blocks before it on stage rank - 1 and those
        after it on stage rank + 1 (whose work the rank class does not read)."""
        last_real = len(self.image) - 1
        if stages is None:
            return StagePlan(1, 1, (0,), self.weights(0, last_real))
        assert stages.vpp == 1, "short forms cut plans of one chunk per stage"
        first = 0 if rank == 0 else stages.first_block[rank]
        last = stages.first_block[rank + 1] - 1 if rank + 1 < stages.pp else last_real
        start, end = self.image[first], self.image[last]
        starts = [0] * rank + [start]
        if rank + 1 < stages.pp:
            starts += [end + 1] + [self.model.layers + 2] * (stages.pp - rank - 2)
        return StagePlan(stages.pp, 1, tuple(starts), self.weights(first, last))


def short_form(model: Model) -> ShortForm | None:
    """The model's short form, or None where it has none (not a transformer, tied weights,
    or no run long enough to cut); one per model config in a process."""
    if not isinstance(model.config, TransformerConfig):
        return None
    if model.config not in _FORMS:
        _FORMS[model.config] = _short_form(model)
    return _FORMS[model.config]


_FORMS: dict = {}  # short_form's, by model config (a handful per process)


def _short_form(model: Model) -> ShortForm | None:
    config = model.config
    if config.tied_embeddings:
        return None
    layers = config.layers
    kinds = ["embedding"] + ["moe" if config.experts is not None and i > config.first_dense_layers else "dense"
                             for i in range(1, layers + 1)] + ["head"]
    keys = [(kinds[j - 1] if j else None, kinds[j], kinds[j + 1] if j <= layers else None)
            for j in range(layers + 2)]
    image, short = [], 0
    j = 0
    while j < len(keys):
        end = j
        while end + 1 < len(keys) and keys[end + 1] == keys[j]:
            end += 1
        n = end - j + 1
        if n > _KEPT:
            image += [short] + [short + 1] * (n - 2) + [short + 2]
            short += _KEPT
        else:
            image += list(range(short, short + n))
            short += n
        j = end + 1
    if short == len(keys):
        return None
    dense = image[config.first_dense_layers] if config.experts is not None and config.first_dense_layers else 0
    cut = replace(config, layers=short - 2, first_dense_layers=dense)
    return ShortForm(Model(cut, model.source), tuple(image))
