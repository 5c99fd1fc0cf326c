"""Colocated vs disaggregated serving (issue 15): per-workload summaries of the two systems of
app/bench/disagg.py and their table rows, the colocated engine as the baseline of the same run.
No target: the report says which way it went."""

from __future__ import annotations

import statistics

from app.bench.stats import percentile, ratio
from app.bench.table import Row

COLOCATED = "kvscope-colocated"
DISAGG = "kvscope-disagg"
DISAGG_SYSTEMS = (COLOCATED, DISAGG)
DISAGG_WORKLOADS = ("interference", "mixed")


def _median(values: list[float | None]) -> float | None:
    xs = [v for v in values if v is not None]
    return statistics.median(xs) if xs else None


def _run_stats(run: dict) -> dict[str, float | None]:
    reqs = run.get("requests", [])
    itl = [x for q in reqs for x in q.get("itl") or []]
    ttft = [q["ttft"] for q in reqs if q.get("ttft") is not None]
    t = run.get("transfer") or {}
    return {
        "itl_p99": percentile(itl, 99),
        "itl_p50": percentile(itl, 50),
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "output_tok_s": run.get("output_tok_s"),
        "transfer_s": t.get("mean_pull_s"),
        "transfer_bytes": t.get("bytes_per_request"),
        "pull_failures": t.get("pull_failures"),
    }


def disagg_summary(runs: list[dict]) -> dict[str, float | None]:
    """Medians over repeats of each run's statistics (failed runs left out)."""
    stats = [_run_stats(r) for r in runs if "error" not in r and "skipped" not in r]
    if not stats:
        return {}
    return {k: _median([s[k] for s in stats]) for k in stats[0]}


def disagg_rows(summary: dict[str, dict[str, dict]]) -> list[Row]:
    rows: list[Row] = []
    for w in DISAGG_WORKLOADS:
        colo, dis = summary.get(w, {}).get(COLOCATED), summary.get(w, {}).get(DISAGG)
        if not colo or not dis:
            continue
        section = f"{w} (disaggregated)"
        for metric, key, lower in (("decode ITL p99 s", "itl_p99", True),
                                   ("decode ITL p50 s", "itl_p50", True),
                                   ("TTFT p50 s", "ttft_p50", True),
                                   ("TTFT p99 s", "ttft_p99", True),
                                   ("output tok/s", "output_tok_s", False)):  # fmt: skip
            v, b = dis.get(key), colo.get(key)
            r = ratio(b, v) if lower else ratio(v, b)  # > 1: disaggregated did better
            rows.append(Row(section, metric, v, b, COLOCATED, r))
        rows.append(Row(section, "KV transfer s per pull", dis.get("transfer_s")))
        rows.append(Row(section, "KV transfer bytes per request", dis.get("transfer_bytes")))
    return rows
