"""The benchmark's statistics (pure python): percentiles, per-workload summaries over repeats,
the interference and KV-occupancy measures."""

from __future__ import annotations

import math
import statistics
from typing import Any

from app.bench.kv_stats import summarize_kv
from app.bench.spec_stats import summarize_spec


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile, q in [0, 100] (numpy's default method)."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def median_of(runs: list[dict], key: str) -> float | None:
    vals = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def pooled(runs: list[dict], key: str) -> list[float]:
    return [q[key] for r in runs for q in r.get("requests", []) if q.get(key) is not None]


def interference_stats(run: dict, long_id: str = "long") -> dict:
    """Decode ITLs of the streams that end while the long prompt is being prefilled, against
    the median ITL of those streams over the whole run."""
    reqs = {q["id"]: q for q in run["requests"]}
    long = reqs[long_id]
    start, end = long["arrival"], long["token_times"][0]
    during, all_itl = [], []
    for q in reqs.values():
        if q["id"] == long_id:
            continue
        t = q["token_times"]
        for a, b in zip(t, t[1:], strict=False):
            all_itl.append(b - a)
            if start < b <= end + 1e-9:
                during.append(b - a)
    med = percentile(all_itl, 50)
    p99 = percentile(during, 99)
    return {"itl_p99_during": p99, "itl_median": med, "p99_over_median": ratio(p99, med),
            "window_s": end - start, "itl_during_count": len(during)}


def decode_throughput(run: dict) -> float | None:
    """Decode tok/s of all streams together: the tokens after each stream's first, over the
    window from the earliest first token to the latest last token (prefill and TTFT excluded;
    one stream: 1 / its mean inter-token latency)."""
    times = [q["token_times"] for q in run.get("requests", []) if q.get("token_times")]
    decoded = sum(len(t) - 1 for t in times)
    if not decoded:
        return None
    window = max(t[-1] for t in times) - min(t[0] for t in times)
    return decoded / window if window > 0 else None


def ideal_paged_occupancy(requests: list[dict], block_size: int) -> float:
    """Filled / allocated slots if every request held exactly ceil(L / block) blocks at each
    length L of its decode: the best paging can do for these lengths (the tail block's waste)."""
    filled = allocated = 0
    for r in requests:
        for length in range(len(r["prompt"]), len(r["prompt"]) + r["max_tokens"]):
            filled += length
            allocated += -(-length // block_size) * block_size
    return filled / allocated


def summarize_workload(name: str, runs: list[dict], workload: dict) -> dict:
    """Median over repeats of the per-run numbers one system produced on one workload."""
    ok = [r for r in runs if "error" not in r and "skipped" not in r]
    if not ok:
        first = runs[0] if runs else {}
        return {"error": first.get("error") or first.get("skipped") or "no runs"}
    s: dict[str, Any] = {
        "runs": len(ok),
        "output_tok_s": median_of(ok, "output_tok_s"),
        "total_tok_s": median_of(ok, "total_tok_s"),
        "wall_s": median_of(ok, "wall_s"),
        "peak_rss_mb": median_of(ok, "peak_rss_mb"),
        "ttft_p50": percentile(pooled(ok, "ttft"), 50),
        "ttft_p99": percentile(pooled(ok, "ttft"), 99),
        "tpot_p50": percentile(pooled(ok, "tpot"), 50),
        "e2e_p50": percentile(pooled(ok, "e2e"), 50),
        "itl_p50": percentile([x for r in ok for q in r["requests"] for x in q["itl"]], 50),
        "itl_p99": percentile([x for r in ok for q in r["requests"] for x in q["itl"]], 99),
        "prefix_hit_rate": median_of(ok, "prefix_hit_rate"),
        "num_preemptions": median_of(ok, "num_preemptions"),
    }
    if name == "single":
        s["decode_tok_s"] = ratio(1.0, s["tpot_p50"])
    if name == "prefill":
        tps = [q["prompt_tokens"] / q["ttft"] for r in ok for q in r["requests"] if q["ttft"]]
        s["prefill_tok_s"] = statistics.median(tps) if tps else None
    if name == "shared-prefix":
        n = len(workload["requests"])
        shareable = (n - 1) * workload["meta"]["shared_prefix"]
        s["hits_of_shareable"] = ratio(median_of(ok, "prefix_cache_hits"), shareable)
        # The first chat can never hit: the steady state is the others'.
        s["ttft_p50_warm"] = percentile(
            [q["ttft"] for r in ok for q in r["requests"][1:] if q["ttft"] is not None], 50)
    if name == "interference":
        per = [interference_stats(r, workload["meta"]["long_id"]) for r in ok]
        s["interference"] = per
        s["itl_p99_over_median"] = statistics.median(
            p["p99_over_median"] for p in per if p["p99_over_median"] is not None)
    if name == "streaming":
        s["streams"] = len(workload["requests"])
        # CPU seconds each process of the system spent in the measured window (engine, HTTP
        # server, client): where the front-end's cost went.
        procs = sorted({p for r in ok for p in (r.get("cpu_s") or {})})
        s["cpu_s"] = {p: median_of([r["cpu_s"] for r in ok if r.get("cpu_s")], p)
                      for p in procs}
        per = [{"front": 1e3 * sum(v for p, v in r["cpu_s"].items() if p != "engine")
                / r["output_tokens"],
                "busy": r["cpu_s"]["engine"] / r["wall_s"] if "engine" in r["cpu_s"] else None}
               for r in ok if r.get("cpu_s") and r.get("output_tokens") and r.get("wall_s")]
        # The front-end's own cost, robust to machine load: server + client CPU per token.
        s["frontend_cpu_ms_per_token"] = median_of(per, "front")
        # How much of the wall time the engine ran: well under 1 = it waited for a core.
        s["engine_cpu_share"] = median_of(per, "busy")
    if name.startswith("streams-"):
        s["streams"] = len(workload["requests"])
        s["decode_tok_s"] = median_of([{"v": decode_throughput(r)} for r in ok], "v")
        # Which weights kvscope decoded with (the workload asks for its CPU default, `auto`).
        for key in ("decode_weights", "kv_cache_dtype"):  # and the KV type it resolved to
            values = {(r.get("model_info") or {}).get(key) for r in ok} - {None}
            if values:
                s[key] = ",".join(sorted(values))
        for key in ("decode_step", "decode_detail"):  # fused, and its kernel (+int8)
            values = {r.get(key) for r in ok} - {None}
            if values:
                s[key] = ",".join(sorted(values))
    s.update(summarize_kv(name, ok, workload))
    s.update(summarize_spec(name, ok, workload))
    kv = [r["kv"] for r in ok if r.get("kv") and r["kv"].get("paged_token_occupancy")]
    block = (ok[0].get("engine_config") or {}).get("block_size")
    if kv and block:
        s["paged_occupancy_ideal"] = ideal_paged_occupancy(workload["requests"], block)
    if kv:
        for key in ("paged_token_occupancy", "contiguous_max_len_occupancy",
                    "contiguous_per_request_occupancy"):
            s[key] = statistics.median(k[key] for k in kv if k[key] is not None)
    return s

