"""The memory-vs-time Pareto front of a search (matplotlib, the optional `plot` extra)."""

from __future__ import annotations

from pathlib import Path

from stg.explore.search import GIB, Result, Row


def pareto(rows: tuple[Row, ...] | list[Row]) -> list[Row]:
    """The plans no other plan beats on both step time and peak memory, fastest first."""
    front: list[Row] = []
    for row in sorted(rows, key=lambda r: (r.estimate.step_us, r.estimate.peak_memory)):
        if not front or row.estimate.peak_memory < front[-1].estimate.peak_memory:
            front.append(row)
    return front


def save_pareto(result: Result, path: str | Path, title: str) -> None:
    """Every valid plan as a point (step time, peak memory per rank), the front joined; PNG or SVG."""
    from stg.view.plots import _figure, save

    fig = _figure(6.5, 4.5)
    ax = fig.add_subplot()
    ax.scatter([r.estimate.step_us / 1e3 for r in result.rows], [r.estimate.peak_memory / GIB for r in result.rows],
               s=12, color="#8c8c8c", label="valid plans")
    front = pareto(result.rows)
    ax.plot([r.estimate.step_us / 1e3 for r in front], [r.estimate.peak_memory / GIB for r in front],
            marker="o", color="#c44e52", label="Pareto front")
    for r in front:
        p = r.plan
        ax.annotate(f"tp{p.tp} pp{p.pp} dp{p.dp} z{p.zero} {p.recompute.value[0]} mb{p.micro_batch}",
                    (r.estimate.step_us / 1e3, r.estimate.peak_memory / GIB), fontsize="xx-small",
                    xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("step time, ms")
    ax.set_ylabel("peak memory per rank, GiB")
    ax.set_title(title, fontsize="small")
    ax.legend(fontsize="x-small")
    save(fig, path)
