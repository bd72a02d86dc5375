"""Plots of a trace set (matplotlib, an optional extra: pip install 'stg[plot]').

memory_figure: per rank class, weights / gradients / optimizer states / activations stacked,
  with the device's memory as a line (summary.json's memory model);
gantt_figure: the pipeline schedule from the timed replay (F, B, W, step; gaps are idle);
comm_figure: communication bytes per step by collective type and by mesh axis, per rank class.
Figures are built on matplotlib's object API (no pyplot state) and saved as PNG or SVG by the
file's suffix, byte-identical for the same input.
"""

from __future__ import annotations

import io
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

from stg.errors import ViewError
from stg.view.comm import ClassComm
from stg.view.gantt import Gantt
from stg.view.traceset import TraceSet

class PlotKind(Enum):
    MEMORY = "memory"
    GANTT = "gantt"
    COMM = "comm"


if TYPE_CHECKING:
    from matplotlib.figure import Figure

FORMATS = ("png", "svg")
GIB = 2**30
MEMORY_PARTS = [("weights", "weights"), ("embedding_weights", "embedding tables"), ("gradients", "gradients"),
                ("optimizer_states", "optimizer states"),
                ("embedding_optimizer_states", "embedding optimizer states"), ("activations", "activations")]
KIND_COLOURS = {"F": "#4c72b0", "B": "#55a868", "W": "#dd8452", "S": "#8c8c8c"}


def _figure(width: float, height: float) -> "Figure":
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ViewError("plots need matplotlib: pip install 'stg[plot]'") from None
    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def memory_figure(trace_set: TraceSet) -> "Figure":
    from stg.device import device_spec

    summary = trace_set.summary
    if summary is None:
        raise ViewError(f"out: {trace_set.out} has no summary.json, so no memory model to plot")
    classes = summary["rank_classes"]
    labels = [trace_set.class_label(c) for c in range(len(classes))]
    fig = _figure(max(5.0, 0.9 * len(classes) + 2.5), 4.0)
    ax = fig.add_subplot()
    bottom = [0.0] * len(classes)
    for key, name in MEMORY_PARTS:
        values = [c["memory"].get(key, 0) / GIB for c in classes]
        if any(values):
            ax.bar(labels, values, bottom=bottom, label=name)
            bottom = [b + v for b, v in zip(bottom, values)]
    capacity = device_spec(summary["plan"]["device"]).memory_gib
    device = summary["plan"]["device"]
    ax.axhline(capacity, color="#c44e52", linestyle="--", label=f"{device} memory ({capacity:g} GiB)")
    ax.set_ylabel("GiB per rank")
    ax.set_title(f"Memory per rank class: {summary['model']['name']}")
    ax.tick_params(axis="x", labelrotation=45 if len(classes) > 6 else 0)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def gantt_figure(chart: Gantt, title: str = "Pipeline schedule") -> "Figure":
    stages = len(chart.bars)
    fig = _figure(10.0, 0.55 * stages + 1.4)
    ax = fig.add_subplot()
    for stage, bars in enumerate(chart.bars):
        ax.broken_barh([(b.start_us, b.end_us - b.start_us) for b in bars], (stage - 0.4, 0.8),
                       facecolors=[KIND_COLOURS[b.kind] for b in bars], edgecolor="white", linewidth=0.5)
        for b in bars:
            if b.end_us - b.start_us > chart.makespan_us / 45:  # a label only where it fits
                ax.text((b.start_us + b.end_us) / 2, stage, b.label, ha="center", va="center", fontsize=6,
                        color="white", clip_on=True)
        ax.text(chart.makespan_us * 1.005, stage, f"idle {chart.idle_share(stage):.0%}", va="center", fontsize=7)
    ax.set_yticks(range(stages), [f"stage {s} (rank {r})" for s, r in enumerate(chart.ranks)])
    ax.set_ylim(stages - 0.5, -0.5)
    ax.set_xlim(0, chart.makespan_us * 1.08 or 1)
    ax.set_xlabel("time (µs)")
    ax.set_title(title)
    from matplotlib.patches import Patch

    used = sorted({b.kind for bars in chart.bars for b in bars}, key="FBWS".index)
    names = {"F": "forward", "B": "backward (input grad)" if "W" in used else "backward", "W": "weight grad",
             "S": "optimizer step"}
    ax.legend(handles=[Patch(color=KIND_COLOURS[k], label=names[k]) for k in used], fontsize="small",
              loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def comm_figure(classes: list[ClassComm], title: str = "Communication per step") -> "Figure":
    fig = _figure(max(8.0, 1.2 * len(classes) + 5), 4.0)
    labels = [c.label for c in classes]
    for position, (field, heading) in enumerate((("by_type", "by collective type"), ("by_axis", "by mesh axis")), 1):
        ax = fig.add_subplot(1, 2, position)
        keys = sorted({k for c in classes for k in getattr(c, field)})
        bottom = [0.0] * len(classes)
        for key in keys:
            values = [getattr(c, field).get(key, 0) / 2**20 for c in classes]
            ax.bar(labels, values, bottom=bottom, label=key)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_title(f"{title}, {heading}", fontsize="medium")
        ax.set_ylabel("MiB per rank")
        ax.tick_params(axis="x", labelrotation=45 if len(classes) > 4 else 0)
        if keys:
            ax.legend(fontsize="x-small")
    return fig


def render(fig: "Figure", fmt: str) -> bytes:
    """The figure as PNG or SVG bytes, the same for the same figure (no dates, fixed ids)."""
    import matplotlib

    if fmt not in FORMATS:
        raise ViewError(f"format: must be png or svg, got {fmt!r}")
    buffer = io.BytesIO()
    metadata = {"Date": None} if fmt == "svg" else {"Software": None}
    with matplotlib.rc_context({"svg.hashsalt": "stg", "svg.fonttype": "path"}):
        fig.savefig(buffer, format=fmt, metadata=metadata)
    return buffer.getvalue()


def save(fig: "Figure", path: str | Path) -> None:
    """Write the figure to ``path``; PNG or SVG by its suffix; all or nothing."""
    from stg.view.timeline import write_bytes_atomically

    path = Path(path)
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in FORMATS:
        raise ViewError(f"output: {path.name} must end in .png or .svg")
    write_bytes_atomically(path, render(fig, fmt))


def save_plot(out: str | Path, kind: PlotKind | str, path: str | Path, *, comm: str = "free",
              alpha_us: float = 5.0, bandwidth_gbps: float = 50.0) -> None:
    """Draw plot ``kind`` (memory, gantt, comm) of the trace set ``out`` into ``path`` (.png or .svg).
    The Gantt chart replays the whole set under ``comm`` and draws one rank per pipeline stage."""
    from stg.view.comm import comm_by_class
    from stg.view.gantt import gantt
    from stg.view.timeline import record_timeline

    try:
        kind = PlotKind(kind)
    except ValueError:
        raise ViewError(f"kind: must be one of {[k.value for k in PlotKind]}, got {kind!r}") from None
    if Path(path).suffix.lower().lstrip(".") not in FORMATS:  # before the work, not after
        raise ViewError(f"output: {Path(path).name} must end in .png or .svg")
    trace_set = TraceSet.open(out)
    if kind is PlotKind.MEMORY:
        fig = memory_figure(trace_set)
    elif kind is PlotKind.COMM:
        fig = comm_figure(comm_by_class(trace_set))
    else:
        timeline = record_timeline(out, comm=comm, ranks=trace_set.one_per_stage(), alpha_us=alpha_us,
                                   bandwidth_gbps=bandwidth_gbps)
        fig = gantt_figure(gantt(timeline), f"Pipeline schedule ({timeline.comm.value} communication)")
    save(fig, path)
