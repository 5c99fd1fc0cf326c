"""Summaries of the KV-memory workloads (app/bench/kv_workloads.py) over repeats: TTFT of the
requests that see a prompt again, what the lower tiers served, and the int8 KV capacity and
decode speed. Pure python; app.bench.stats.summarize_workload adds these to its own keys."""

from __future__ import annotations

import statistics
from typing import Any


def _median(values: list[float]) -> float | None:
    xs = [v for v in values if v is not None]
    return statistics.median(xs) if xs else None


def _ttft_p50(runs: list[dict], ids: set[str], key: str = "requests") -> float | None:
    return _median([q["ttft"] for r in runs for q in r.get(key, []) if q["id"] in ids])


def _pool(run: dict) -> tuple[int, int] | None:
    """(blocks, block size) of the run's KV pool, from the engine."""
    cfg = run.get("engine_config") or {}
    if cfg.get("num_kv_blocks") is None or not cfg.get("block_size"):
        return None
    return cfg["num_kv_blocks"], cfg["block_size"]


def tier_summary(name: str, runs: list[dict], workload: dict) -> dict[str, Any]:
    """tiered / restart: median TTFT of the measured requests (a prompt seen before), of the
    first sight of a prompt, and the share of the shareable tokens the lower tiers served."""
    meta = workload["meta"]
    measured = set(meta["measured"])
    s: dict[str, Any] = {"ttft_seen_p50": _ttft_p50(runs, measured),
                         "measured_requests": len(measured)}
    if name == "restart":
        s["ttft_first_p50"] = _ttft_p50(runs, set(meta["prime"]), key="prime_requests")
        s["restart_s"] = _median([r.get("restart_s") for r in runs])
        s["shutdown_s"] = _median([r.get("shutdown_s") for r in runs])
    else:
        first = {q["id"] for q in workload["requests"]} - measured
        s["ttft_first_p50"] = _ttft_p50(runs, first)
    tiers = [r.get("tiers") or {} for r in runs]
    hits = _median([t.get("external_prefix_cache_hits", 0) for t in tiers])
    s["tier_hit_tokens"] = hits
    s["tier_hit_share"] = hits / meta["shareable_tokens"] if meta.get("shareable_tokens") else None
    for tier in ("host", "disk"):
        if any(f"kv_{tier}_hits" in t for t in tiers):
            s[f"{tier}_hit_blocks"] = _median([t.get(f"kv_{tier}_hits", 0) for t in tiers])
    return s


def int8_summary(name: str, runs: list[dict], workload: dict) -> dict[str, Any]:
    """kv-capacity: peak sequences at once and pool tokens at the fixed kv_cache_memory;
    kv-decode-4k: decode tok/s at that context and how many such sequences the pool holds."""
    meta = workload["meta"]
    pools = [p for p in map(_pool, runs) if p is not None]
    s: dict[str, Any] = {"context": meta["context"], "kv_cache_memory": meta["kv_cache_memory"],
                         "pool_tokens": _median([b * size for b, size in pools])}
    if name == "kv-capacity":
        s["peak_concurrent"] = _median([r.get("peak_concurrent") for r in runs])
    else:
        s["seqs_fit"] = _median([b // -(-meta["context"] // size) for b, size in pools])
        tpots = [q["tpot"] for r in runs for q in r.get("requests", []) if q.get("tpot")]
        s["decode_tok_s"] = 1.0 / statistics.median(tpots) if tpots else None
    return s


def summarize_kv(name: str, runs: list[dict], workload: dict) -> dict[str, Any]:
    """The KV workloads' own keys ({} for every other workload); `runs` are the good ones."""
    if name in ("tiered", "restart"):
        return tier_summary(name, runs, workload)
    if name in ("kv-capacity", "kv-decode-4k"):
        return int8_summary(name, runs, workload)
    return {}
