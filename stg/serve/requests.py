"""Request traces: JSON Lines or CSV, one request a record, in either public schema.

  Azure LLM inference trace (2023/2024):  TIMESTAMP, ContextTokens, GeneratedTokens
      TIMESTAMP a date-time ("2023-11-16 18:15:46.6805900") or seconds
  Mooncake trace (FAST '25):              timestamp, input_length, output_length
      timestamp in milliseconds

Arrival times are made relative to the earliest request; requests are ordered by arrival
(ties keep file order) and numbered 0.. in that order.
"""

from __future__ import annotations

import csv
import json
from datetime import datetime
from pathlib import Path

from stg.errors import PlanError
from stg.serve.scheduler import Request

SCHEMAS = {  # name: (arrival, prompt, output, seconds per arrival unit)
    "azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens", 1.0),
    "mooncake": ("timestamp", "input_length", "output_length", 1e-3),
}


def _records(path: Path) -> list[dict]:
    try:
        text = path.read_text()
    except OSError as err:
        raise PlanError(f"requests: cannot read {path} ({err.strerror})") from None
    if path.suffix in (".jsonl", ".json"):
        records = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise PlanError(f"requests: {path} line {number}: not JSON ({err.msg})") from None
        return records
    if path.suffix == ".csv":
        return list(csv.DictReader(text.splitlines()))
    raise PlanError(f"requests: {path} must be .jsonl or .csv")


def _seconds(value, unit: float, where: str) -> float:
    if isinstance(value, str):
        try:
            return float(value) * unit
        except ValueError:
            try:
                return datetime.fromisoformat(value.strip()[:26]).timestamp()
            except ValueError:
                raise PlanError(f"{where}: arrival {value!r} is neither a number nor a date-time") from None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value) * unit
    raise PlanError(f"{where}: arrival {value!r} is not a time")


def _count(value, field: str, where: str) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise PlanError(f"{where}: {field} must be a positive integer, got {value!r}") from None
    if number <= 0 or str(number) != str(value).strip() and number != value:
        raise PlanError(f"{where}: {field} must be a positive integer, got {value!r}")
    return number


def load_requests(path: str | Path) -> list[Request]:
    path = Path(path)
    records = _records(path)
    if not records:
        raise PlanError(f"requests: {path} holds no requests")
    keys = set(records[0])
    schema = next((name for name, (a, p, o, _) in SCHEMAS.items() if {a, p, o} <= keys), None)
    if schema is None:
        wanted = "; ".join(f"{n}: {', '.join(s[:3])}" for n, s in SCHEMAS.items())
        raise PlanError(f"requests: {path} has fields {sorted(keys)}; expected one schema ({wanted})")
    arrival, prompt, output, unit = SCHEMAS[schema]
    parsed = []
    for number, record in enumerate(records, 1):
        where = f"requests: {path} record {number}"
        if not {arrival, prompt, output} <= set(record):
            raise PlanError(f"{where}: missing field(s) of the {schema} schema")
        parsed.append((_seconds(record[arrival], unit, where), _count(record[prompt], prompt, where),
                       _count(record[output], output, where)))
    start = min(t for t, _, _ in parsed)
    parsed.sort(key=lambda r: r[0])
    return [Request(i, t - start, p, o) for i, (t, p, o) in enumerate(parsed)]
