"""The pipeline schedule as a Gantt chart's data: per stage, one bar per action (`3F0`, `3B0`,
`3W0`, the optimizer step `S`) from the timed replay, and what is left idle.

A bar runs from the action's first compute node's start to its last one's end; its busy time
is the sum of those nodes' durations. A stage's idle share is 1 - busy / makespan: for 1F1B
with equal stages and free communication, the textbook (p - 1) / (m + p - 1).
"""

from __future__ import annotations

from dataclasses import dataclass

from stg.view.timeline import SliceKind, Timeline


@dataclass(frozen=True)
class Bar:
    label: str  # `3F0`; `S` for the optimizer step
    start_us: float
    end_us: float
    busy_us: float

    @property
    def kind(self) -> str:
        """F, B, W or S."""
        return self.label if self.label == "S" else self.label.rstrip("0123456789")[-1]


@dataclass(frozen=True)
class Gantt:
    ranks: tuple[int, ...]  # the rank drawn for each stage
    bars: tuple[tuple[Bar, ...], ...]  # by stage, in start order
    makespan_us: float

    def busy_us(self, stage: int) -> float:
        return sum(b.busy_us for b in self.bars[stage])

    def idle_share(self, stage: int) -> float:
        return 1 - self.busy_us(stage) / self.makespan_us if self.makespan_us else 0.0


def gantt(timeline: Timeline) -> Gantt:
    """One row per pipeline stage, drawn from the lowest recorded rank of that stage."""
    rows: dict[int, int] = {}
    for rank in timeline.ranks:
        rows.setdefault(timeline.stages[rank], rank)
    ranks = tuple(rows[s] for s in sorted(rows))
    bars = []
    for rank in ranks:
        spans: dict[str, list[float]] = {}
        for s in timeline.slices[rank]:
            if s.kind is SliceKind.COMPUTE and s.action:
                span = spans.setdefault(s.action, [s.start_us, s.end_us, 0.0])
                span[0], span[1] = min(span[0], s.start_us), max(span[1], s.end_us)
                span[2] += s.duration_us
        bars.append(tuple(sorted((Bar(label, *span) for label, span in spans.items()),
                                 key=lambda b: (b.start_us, b.label))))
    return Gantt(ranks, tuple(bars), timeline.makespan_us)
