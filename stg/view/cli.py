"""`stg timeline`, `stg plot`, `stg report`: pictures of a written trace set (registered in stg/cli.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

COMM_OPTION = typer.Option("free", help="Communication cost in the replay: 'free' (collectives end when the last member joins, sends take no time) or 'alpha-beta' (--alpha-us + ring bytes / --bandwidth-gbps), as in `stg validate --timed`.")
ALPHA_US = typer.Option(5.0, help="alpha-beta: latency per collective or send, µs.")
BANDWIDTH_GBPS = typer.Option(50.0, help="alpha-beta: bandwidth per rank, GB/s (1 GB = 1e9 B).")


def timeline(
    out: Path = typer.Argument(..., help="A trace set directory written by `stg generate`."),
    output: Path = typer.Option(..., "--output", "-o", help="The Chrome trace JSON to write (open it in ui.perfetto.dev or chrome://tracing)."),
    comm: str = COMM_OPTION,
    ranks: Optional[str] = typer.Option(None, help="Ranks to show, e.g. 0,4,8:12 (all ranks are replayed regardless). [default: the first rank of each rank class]"),
    alpha_us: float = ALPHA_US,
    bandwidth_gbps: float = BANDWIDTH_GBPS,
):
    """Write the timed replay of a trace set as a timeline: one process per rank, a compute and a communication track (plus receive tracks), one slice per node with its FLOPs, bytes, collective type and group in args, flow arrows from each send to its receive, markers where micro-batch actions and the optimizer step begin."""
    from stg.cli import _user_errors, err
    from stg.view.timeline import write_timeline
    from stg.view.traceset import TraceSet, parse_ranks

    with _user_errors():
        chosen = parse_ranks(ranks, TraceSet.open(out).world_size) if ranks else None
        made = write_timeline(out, output, comm=comm, ranks=chosen, alpha_us=alpha_us, bandwidth_gbps=bandwidth_gbps)
    nodes = sum(len(made.slices[r]) for r in made.ranks)
    err.print(f"{nodes:,} nodes of ranks {list(made.ranks)}, makespan {made.makespan_us:,.1f} us -> {output}",
              highlight=False, soft_wrap=True)


def plot(
    out: Path = typer.Argument(..., help="A trace set directory written by `stg generate`."),
    kind: str = typer.Argument(..., help="memory (per rank class, stacked, with the device's capacity), gantt (the pipeline schedule from the timed replay, one row per stage) or comm (bytes by collective type and by mesh axis, per rank class)."),
    output: Path = typer.Option(..., "--output", "-o", help="The picture to write: .png or .svg. Needs pip install 'stg[plot]'."),
    comm: str = COMM_OPTION,
    alpha_us: float = ALPHA_US,
    bandwidth_gbps: float = BANDWIDTH_GBPS,
):
    """Draw one plot of a trace set."""
    from stg.cli import _user_errors
    from stg.view.plots import save_plot

    with _user_errors():
        save_plot(out, kind, output, comm=comm, alpha_us=alpha_us, bandwidth_gbps=bandwidth_gbps)


def report(
    out: Path = typer.Argument(..., help="A trace set directory written by `stg generate`."),
    output: Path = typer.Option(..., "--output", "-o", help="The HTML page to write; it needs no network to open. Needs pip install 'stg[plot]'."),
    alpha_us: float = ALPHA_US,
    bandwidth_gbps: float = BANDWIDTH_GBPS,
):
    """Write a one-page HTML report: the plan, the per-class summary tables, the headline numbers of the timed replay (step time under free and alpha-beta communication, bubble fraction, exposed communication) and the plots as inline SVG."""
    from stg.cli import _user_errors
    from stg.view.report import write_report

    with _user_errors():
        write_report(out, output, alpha_us=alpha_us, bandwidth_gbps=bandwidth_gbps)
