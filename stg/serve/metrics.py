"""Serving metrics: per-request TTFT, TPOT and end-to-end latency from the timed iterations,
and their totals (throughput, percentiles, goodput under SLOs)."""

from __future__ import annotations

from typing import Sequence

from stg.serve.scheduler import Request


def request_metrics(requests: Sequence[Request], timed) -> list[dict]:
    """Per request: TTFT (the end of the iteration that sampled its first token, minus its
    arrival), TPOT and end-to-end latency; `timed`: the Timed iterations that ran it."""
    first, last = {}, {}
    for t in timed:
        for slot in t.slots:
            if slot.samples:
                first.setdefault(slot.request, t.end_s)
                last[slot.request] = t.end_s
    rows = []
    for r in requests:
        ttft, e2e = first[r.id] - r.arrival_s, last[r.id] - r.arrival_s
        tpot = (last[r.id] - first[r.id]) / (r.output - 1) if r.output > 1 else None
        rows.append({"request": r.id, "arrival_s": r.arrival_s, "prompt": r.prompt, "output": r.output,
                     "ttft_s": ttft, "tpot_s": tpot, "e2e_s": e2e})
    return rows


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    ordered = sorted(values)
    pick = lambda p: ordered[min(len(ordered) - 1, int(p * len(ordered)))]
    return {"mean": sum(ordered) / len(ordered), "p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99)}


def totals(rows: list[dict], makespan: float, slo_ttft_s: float | None, slo_tpot_s: float | None) -> dict:
    tokens = sum(r["output"] for r in rows)
    result = {"requests": len(rows), "output_tokens": tokens, "makespan_s": makespan,
              "throughput_tokens_per_s": tokens / makespan if makespan else None,
              "ttft_s": _percentiles([r["ttft_s"] for r in rows]),
              "tpot_s": _percentiles([r["tpot_s"] for r in rows if r["tpot_s"] is not None]),
              "e2e_s": _percentiles([r["e2e_s"] for r in rows])}
    if slo_ttft_s is not None or slo_tpot_s is not None:
        good = [r for r in rows if (slo_ttft_s is None or r["ttft_s"] <= slo_ttft_s)
                and (slo_tpot_s is None or r["tpot_s"] is None or r["tpot_s"] <= slo_tpot_s)]
        result["goodput_tokens_per_s"] = sum(r["output"] for r in good) / makespan if makespan else None
        result["slo_attainment"] = len(good) / len(rows)
    return result
