"""`stg report`: one self-contained HTML page about a trace set: the plan, the per-class
summary tables, the headline numbers of its timed replay and the plots as inline SVG. The page
loads nothing from anywhere: no scripts, styles or images outside the file.

Headline numbers, from two replays of the whole set: the makespan under free communication
(the compute critical path) and under alpha-beta; the bubble fraction, the mean over ranks of
idle / makespan under free communication (the time a rank waits for its peers: pipeline
bubbles, load imbalance); exposed communication, how much longer the alpha-beta step takes
than the free one (communication that compute does not hide).
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass
from pathlib import Path

from stg.chakra.replay import CommModel, Timing
from stg.chakra.validate import timed_replay
from stg.errors import ViewError
from stg.view import plots
from stg.view.comm import comm_by_class
from stg.view.gantt import gantt
from stg.view.timeline import record_timeline, write_text_atomically
from stg.view.traceset import TraceSet

GIB = 2**30


@dataclass(frozen=True)
class Headline:
    makespan_free_us: float
    makespan_us: float  # under alpha-beta
    bubble_fraction: float
    exposed_comm_us: float

    @classmethod
    def of(cls, free: Timing, costed: Timing) -> "Headline":
        shares = [idle / free.makespan_us for idle in free.idle_us] if free.makespan_us else [0.0]
        return cls(free.makespan_us, costed.makespan_us, sum(shares) / len(shares),
                   costed.makespan_us - free.makespan_us)


def make_report(out: str | Path, *, alpha_us: float = 5.0, bandwidth_gbps: float = 50.0) -> str:
    """The report page of ``out`` as HTML text."""
    trace_set = TraceSet.open(out)
    free = record_timeline(out, comm=CommModel.FREE, ranks=trace_set.one_per_stage())
    try:
        costed = timed_replay(out, comm=CommModel.ALPHA_BETA, alpha_us=alpha_us, bandwidth_gbps=bandwidth_gbps)
    except ValueError as error:  # a bad alpha or bandwidth
        raise ViewError(str(error)) from None
    headline = Headline.of(free.timing, costed)
    figures = [("Memory per rank", plots.memory_figure(trace_set) if trace_set.summary else None),
               ("Pipeline schedule (free communication)", plots.gantt_figure(gantt(free))),
               ("Communication", plots.comm_figure(comm_by_class(trace_set)))]
    summary = trace_set.summary or {}
    title = (f"{summary['model']['name']} on {summary['world_size']} ranks" if summary
             else f"{trace_set.world_size} ranks")
    parts = [f"<h1>{html.escape(title)}</h1>", f"<p class=note>{html.escape(str(trace_set.out))}</p>",
             _headline_table(headline, alpha_us, bandwidth_gbps)]
    if summary:
        parts += ["<h2>Plan</h2>", _plan_table(summary), "<h2>Per rank class (per step, per rank)</h2>",
                  _class_table(trace_set)]
    for heading, fig in figures:
        if fig is not None:
            parts += [f"<h2>{html.escape(heading)}</h2>", _inline_svg(plots.render(fig, "svg").decode())]
    return _PAGE.format(title=html.escape(title), body="\n".join(parts))


def write_report(out: str | Path, path: str | Path, **options) -> None:
    """Write ``make_report(out)`` to ``path`` (all or nothing)."""
    write_text_atomically(Path(path), make_report(out, **options))


def _inline_svg(svg: str) -> str:
    """Matplotlib's SVG file as an element: no XML prolog, doctype, RDF metadata or namespace URIs."""
    svg = re.sub(r"<\?xml[^>]*\?>|<!DOCTYPE[^>]*>", "", svg)
    svg = re.sub(r"<metadata>.*?</metadata>", "", svg, flags=re.S)
    svg = re.sub(r' xmlns(:xlink)?="[^"]*"', "", svg)  # HTML's parser knows SVG's namespaces
    return f"<figure>{svg.strip()}</figure>"


def _table(head: list[str], rows: list[list[str]]) -> str:
    cells = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{cells}</tr></thead><tbody>{body}</tbody></table>"


def _headline_table(h: Headline, alpha_us: float, bandwidth_gbps: float) -> str:
    share = f" ({h.exposed_comm_us / h.makespan_us:.1%} of the step)" if h.makespan_us else ""
    return _table(["headline", "value"], [
        ["step time, free communication", f"{h.makespan_free_us:,.1f} µs"],
        [f"step time, alpha-beta ({alpha_us:g} µs, {bandwidth_gbps:g} GB/s)", f"{h.makespan_us:,.1f} µs"],
        ["bubble fraction (mean idle share, free communication)", f"{h.bubble_fraction:.1%}"],
        ["exposed communication (alpha-beta minus free step time)", f"{h.exposed_comm_us:,.1f} µs{share}"],
    ])


def _plan_table(summary: dict) -> str:
    rows = [[k, str(v)] for k, v in summary["plan"].items() if v is not None]
    rows.insert(0, ["model", f"{summary['model']['name']} ({summary['model']['params']:,} parameters)"])
    rows.append(["micro-batches per rank", str(summary["microbatches"])])
    return _table(["", ""], rows)


def _class_table(trace_set: TraceSet) -> str:
    classes = trace_set.summary["rank_classes"]
    kinds = sorted({k for c in classes for k in c["comm_bytes"]})
    memory = sorted({k for c in classes for k in c["memory"]}, key=lambda k: (k == "peak", k))
    rows = [["ranks", *(str(c["count"]) for c in classes)],
            ["TFLOP", *(f"{c['flops'] / 1e12:,.4f}" for c in classes)]]
    rows += [[f"{k} GiB (count)", *(f"{c['comm_bytes'].get(k, 0) / GIB:,.4f} ({c['comm_count'].get(k, 0)})"
                                    for c in classes)] for k in kinds]
    rows.append(["send / recv GiB", *(f"{c['send_bytes'] / GIB:,.4f} / {c['recv_bytes'] / GIB:,.4f}"
                                      for c in classes)])
    rows += [[f"memory {k} GiB", *(f"{c['memory'].get(k, 0) / GIB:,.3f}" for c in classes)] for k in memory]
    rows.append(["nodes", *(f"{sum(c['nodes'].values()):,}" for c in classes)])
    return _table(["", *(trace_set.class_label(i) for i in range(len(classes)))], rows)


_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{title}</title>
<style>
body {{ font-family: sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }}
table {{ border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }}
th, td {{ border: 1px solid #ccc; padding: 0.2em 0.6em; text-align: right; }}
th:first-child, td:first-child {{ text-align: left; }}
figure {{ margin: 0; }} figure svg {{ max-width: 100%; height: auto; }}
.note {{ color: #777; font-size: 0.8em; }}
</style>
</head>
<body>
{body}
</body>
</html>
"""
