"""A long transformer evaluated on a short one (stg.evaluate).

A transformer's blocks are copies of one template per kind (dense, MoE), and what a block
adds to a rank's summary -- its ops' FLOPs and bytes, its collectives, its weights, gradients
and saved activations, what it sends to and receives from a neighbouring stage -- depends on
its kind and its neighbours' alone (measured on the sharded graphs: the largest distance at
which a block reads another is one block, benchmarks/layer_classes.py). Blocks whose kind
and both neighbours' kinds agree are alike; a run of alike blocks has a first block, a last
one, and interior blocks between, all alike.

So the symbolic passes run once on a short model, where every run of more than 2 v + 1
alike blocks (v: the plan's chunks per pipeline stage) keeps its first block, its last and
2 v - 1 interior ones: llama3-405b's 126 blocks become 5 for v = 1. Each pipeline stage of
the real plan then reads a cut of its own of the short model (ShortForm.stage_plans): real
block j maps to short block f(j), f monotone, a run's first and last blocks on the first and
last kept, the stage's interior blocks on interior ones, so that each of its blocks is
alike to the real one; each short block of the stage counts as often as the real blocks of
the stage that map to it (StagePlan.weights). Other stages' blocks are there as the stage's
neighbours: what a stage receives from them and sends to them is what the blocks next to it
make and read, so a stretch of other stages' interior blocks next to a run's first or last
block goes with that block, and any other stretch has an interior block of its own (at most
v stretches of the stage's chunks and v - 1 of others between them: 2 v - 1). A short block
runs on the stage of the first real block that maps to it: the embedding and the head stay on
the real cut's first and last stages, so a tied model's weights untie alike in every cut.
Nothing in a summary names an op, so the rows are the real model's exactly
(tests/test_short.py checks them against the full passes)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from itertools import groupby

from model_zoo import Model
from model_zoo.transformer import TransformerConfig
from parallelism.pipeline import StagePlan


@dataclass(frozen=True)
class _Run:
    """Real blocks first..last, alike; short blocks start..start + kept - 1 keep them."""

    first: int
    last: int
    start: int
    kept: int


@dataclass(frozen=True)
class ShortForm:
    """A model's short form for plans of some number of chunks per pipeline stage."""

    model: Model  # the short model
    runs: tuple[_Run, ...]  # every real block in one, in order
    _plans: dict = field(default_factory=dict, compare=False, repr=False)  # stage_plans's, by cut

    @property
    def blocks(self) -> int:
        """Real blocks, the embedding and the head included."""
        return self.runs[-1].last + 1

    @cached_property
    def interior(self) -> frozenset[int]:
        """The short blocks that may stand for several real ones: a cut run's interior ones."""
        return frozenset(block for run in self.runs if run.kept < run.last - run.first + 1
                         for block in range(run.start + 1, run.start + run.kept - 1))

    def stage_plans(self, stages: StagePlan | None) -> tuple[StagePlan, ...]:
        """Per pipeline stage of `stages` (None: one stage), its cut of the short model."""
        if stages not in self._plans:
            stage_of = [0] * self.blocks if stages is None else [stages.virtual_stage(j) for j in range(self.blocks)]
            self._plans[stages] = tuple(self._stage_plan(stages, stage_of, rank)
                                        for rank in range(stages.pp if stages else 1))
        return self._plans[stages]

    def _stage_plan(self, stages: StagePlan | None, stage_of: list[int], rank: int) -> StagePlan:
        """Pipeline stage `rank`'s cut: the short blocks that its chunks' real blocks map to,
        weighed by how many do, on its virtual stages; other stages' real blocks on theirs
        (`stage_of`: each real block's virtual stage)."""
        pp = stages.pp if stages else 1
        mine = [stage % pp == rank for stage in stage_of]
        image = self._image([stage if own else None for stage, own in zip(stage_of, mine)])
        weights = [0] * (self.model.layers + 2)
        for j, block in enumerate(image):
            weights[block] += mine[j]
        # a short block runs on the stage of the first real block that maps to it (other stages'
        # blocks in one stretch: the first of those stages); a stage that runs none is empty
        runs_on: dict[int, int] = {}
        for j, block in enumerate(image):
            runs_on.setdefault(block, stage_of[j])
        starts: list = [None] * (pp * (stages.vpp if stages else 1))
        for block in sorted(runs_on, reverse=True):
            starts[runs_on[block]] = block
        following = self.model.layers + 2
        for stage in reversed(range(len(starts))):
            following = starts[stage] = following if starts[stage] is None else starts[stage]
        # (a short block stands for blocks of this stage alone or of others alone: those weigh 1)
        return StagePlan(pp, stages.vpp if stages else 1, tuple(starts), tuple(w or 1 for w in weights))

    def _image(self, owner: list) -> list[int]:
        """f: per real block, its short block, given each real block's owner (the stage's
        virtual stage that runs it, or None: another stage's)."""
        image = []
        for run in self.runs:
            n = run.last - run.first + 1
            if n == run.kept:
                image += range(run.start, run.start + n)
                continue
            # the first and last blocks on the first and last kept; the interior's stretches of
            # one owner each on interior blocks of their own (the spare ones to the longest),
            # but for other stages' blocks next to a first or last block of other stages, which
            # go with it (what a stage reads of its neighbours' blocks is what their block makes)
            # where the rest have blocks enough
            stretches = [(who, len(list(group))) for who, group in groupby(owner[run.first + 1:run.last])]
            head = stretches[0][1] if stretches and stretches[0][0] is None is owner[run.first] else 0
            tail = stretches[-1][1] if len(stretches) > bool(head) and stretches[-1][0] is None is owner[run.last] \
                else 0
            rest = stretches[bool(head):len(stretches) - bool(tail)]
            if sum(length for _, length in rest) < run.kept - 2:
                head, tail, rest = 0, 0, stretches
            assert len(rest) <= run.kept - 2, "a run's stretches outnumber its interior blocks"
            given = [1] * len(rest)
            for _ in range(run.kept - 2 - len(rest)):
                longest = max(range(len(rest)), key=lambda s: rest[s][1] - given[s])
                given[longest] += 1
            image += [run.start] * (1 + head)
            block = run.start + 1
            for (_, length), count in zip(rest, given):
                image += [block + min(i, count - 1) for i in range(length)]
                block += count
            image += [run.start + run.kept - 1] * (tail + 1)
        return image


def short_form(model: Model, chunks: int = 1) -> ShortForm | None:
    """The model's short form for plans of `chunks` chunks per pipeline stage, or None where
    it has none (not a transformer, or no run long enough to cut); one per model config and
    chunks in a process."""
    if not isinstance(model.config, TransformerConfig):
        return None
    key = (model.config, chunks)
    if key not in _FORMS:
        _FORMS[key] = _short_form(model, chunks)
    return _FORMS[key]


_FORMS: dict = {}  # short_form's, by model config and chunks (a handful per process)


def _short_form(model: Model, chunks: int) -> ShortForm | None:
    config = model.config
    layers, keep = config.layers, 2 * chunks + 1
    kinds = ["embedding"] + ["moe" if config.experts is not None and i > config.first_dense_layers else "dense"
                             for i in range(1, layers + 1)] + ["head"]
    keys = [(kinds[j - 1] if j else None, kinds[j], kinds[j + 1] if j <= layers else None)
            for j in range(layers + 2)]
    runs, first, start = [], 0, 0
    for _, group in groupby(keys):
        n = len(list(group))
        runs.append(_Run(first, first + n - 1, start, min(n, keep)))
        first, start = first + n, start + min(n, keep)
    if start == len(keys):
        return None
    # the short model's kinds are the kept blocks' (its dense blocks: those the last dense one's run keeps)
    dense = next(run.start + min(config.first_dense_layers - run.first, run.kept - 1) for run in runs
                 if run.first <= config.first_dense_layers <= run.last) if config.first_dense_layers else 0
    return ShortForm(Model(replace(config, layers=start - 2, first_dense_layers=dense), model.source), tuple(runs))
