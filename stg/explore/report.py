"""What `stg explore` prints: a ranked rich table, or every valid plan as JSON or CSV."""

from __future__ import annotations

import csv
import io
import json

from rich.table import Table

from stg.explore.search import PLAN_KEYS, Result

# (header, row key, format) of the table's measured columns
COLUMNS = (("step ms", "step_ms", "{:,.1f}"), ("tokens/s", "tokens_per_s", "{:,.0f}"), ("MFU", "mfu", "{:.1%}"),
           ("peak GiB", "peak_memory_gib", "{:.1f}"), ("bubble", "bubble", "{:.1%}"),
           ("exposed comm ms", "exposed_comm_ms", "{:,.1f}"))


def table(result: Result, top: int, title: str) -> Table:
    out = Table(title=title)
    out.add_column("#", justify="right")
    out.add_column("plan")
    for header, _, _ in COLUMNS:
        out.add_column(header, justify="right")
    for i, row in enumerate(result.rows[:top], 1):
        data = row.to_dict()
        plan = " ".join(f"{k}={data[k]}" for k in PLAN_KEYS if _shown(k, data))
        out.add_row(str(i), plan, *(fmt.format(data[key]) for _, key, fmt in COLUMNS))
    return out


def _shown(key: str, plan: dict) -> bool:
    """Whether the table shows a plan field: not a degree of 1 that most plans have, not an
    unused field, and of a recommendation model only its data-parallel and table layout."""
    if plan[key] is None or (key in ("vpp", "cp", "ep", "local_world_size") and plan[key] == 1):
        return False
    return not (plan["embedding_sharding"] and key in ("tp", "pp", "sp", "schedule", "zero", "recompute"))


def footer(result: Result) -> str:
    dropped = ", ".join(f"{n} {why}" for why, n in result.dropped.items()) or "none"
    rate = result.considered / result.seconds if result.seconds else 0.0
    return (f"{len(result.rows)} valid of {result.considered} plans in {result.seconds:.1f} s "
            f"({rate:.2f} plans/s); dropped: {dropped}")


def to_json(result: Result) -> str:
    return json.dumps(result.to_dict(), indent=1)


def to_csv(result: Result) -> str:
    rows = [r.to_dict() for r in result.rows]
    buffer = io.StringIO()
    keys = list(rows[0]) if rows else list(PLAN_KEYS)
    writer = csv.DictWriter(buffer, fieldnames=keys, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: row.get(k, 0) for k in keys})
    return buffer.getvalue()
