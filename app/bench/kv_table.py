"""Table rows of the KV-memory workloads (issue 14): lower KV tiers against recomputing, and
int8 KV against the model-dtype KV, each measured in the same run, with the issue's targets."""

from __future__ import annotations

from app.bench.stats import ratio
from app.bench.table import Row, check

RECOMPUTE = "kvscope-recompute"
MODEL_DTYPE_KV = "kvscope"
INT8_KV = "kvscope-kvint8"
TTFT_TARGET = 10.0  # >= 10x lower median TTFT than recomputing (host tier, warm disk)
CAPACITY_TARGET = 1.9  # >= 1.9x the concurrent sequences of the model-dtype pool


def _get(summary: dict, workload: str, system: str, key: str) -> float | None:
    return summary.get(workload, {}).get(system, {}).get(key)


def _meta(summary: dict, workload: str, key: str) -> float | None:
    """A workload fact every system's summary carries (the first that has it)."""
    for s in summary.get(workload, {}).values():
        if s.get(key) is not None:
            return s[key]
    return None


def _lower_is_better(section: str, metric: str, summary: dict, system: str, base: str,
                     key: str, bound: float | None = None) -> Row:
    v, b = _get(summary, section, system, key), _get(summary, section, base, key)
    r = ratio(b, v)
    target = f">= {bound:g}x {base}" if bound else ""
    return Row(section, metric, v, b, base, r, target, check(r, ">=", bound) if bound else None)


def _share(section: str, metric: str, summary: dict, system: str) -> Row:
    return Row(section, metric, _get(summary, section, system, "tier_hit_share"))


def tier_rows(summary: dict) -> list[Row]:
    rows: list[Row] = []
    if "tiered" in summary:
        n = _tokens(_meta(summary, "tiered", "measured_requests"))
        for tier, system in (("host tier", "kvscope-host"), ("disk tier", "kvscope-disk")):
            rows.append(_lower_is_better(
                "tiered", f"TTFT p50 s, prompt seen before ({n} requests): {tier} vs recompute",
                summary, system, RECOMPUTE, "ttft_seen_p50", TTFT_TARGET))
        for tier, system in (("host tier", "kvscope-host"), ("disk tier", "kvscope-disk")):
            rows.append(_lower_is_better(
                "tiered", f"TTFT p50 s, first sight of a prompt: {tier} vs recompute", summary,
                system, RECOMPUTE, "ttft_first_p50"))
            rows.append(_share("tiered", f"{tier}: share of seen system-prompt tokens it served",
                               summary, system))
    if "restart" in summary:
        rows.append(_lower_is_better(
            "restart", "TTFT p50 s after a restart, prompt seen before: disk-warm vs cold",
            summary, "kvscope-disk", RECOMPUTE, "ttft_seen_p50", TTFT_TARGET))
        rows.append(_share("restart", "disk tier: share of the prompt's tokens it served",
                           summary, "kvscope-disk"))
        v = _get(summary, "restart", "kvscope-disk", "restart_s")
        b = _get(summary, "restart", RECOMPUTE, "restart_s")
        rows.append(Row("restart", "engine start s (load, disk index): disk-warm vs cold", v, b,
                        RECOMPUTE, ratio(v, b)))
    return rows


def _tokens(n: float | None) -> str:
    return "?" if n is None else f"{n:,.0f}"


def _mib(summary: dict, workload: str) -> str:
    memory = _meta(summary, workload, "kv_cache_memory")
    return f"{memory / 2**20:g} MiB" if memory else "fixed"


def int8_rows(summary: dict) -> list[Row]:
    rows: list[Row] = []

    def versus(section: str, metric: str, key: str, bound: float | None = None) -> None:
        v, b = _get(summary, section, INT8_KV, key), _get(summary, section, MODEL_DTYPE_KV, key)
        r = ratio(v, b)
        target = f">= {bound:g}x {MODEL_DTYPE_KV}" if bound else ""
        rows.append(Row(section, metric, v, b, MODEL_DTYPE_KV, r, target,
                        check(r, ">=", bound) if bound else None))

    if "kv-capacity" in summary:
        ctx = _tokens(_meta(summary, "kv-capacity", "context"))
        mem = _mib(summary, "kv-capacity")
        versus("kv-capacity", f"sequences at once ({ctx}-token context, {mem} KV): int8 vs "
               "model dtype", "peak_concurrent", CAPACITY_TARGET)
        versus("kv-capacity", f"KV pool tokens at {mem}: int8 vs model dtype", "pool_tokens")
    if "kv-decode-4k" in summary:
        ctx = _tokens(_meta(summary, "kv-decode-4k", "context"))
        mem = _mib(summary, "kv-decode-4k")
        versus("kv-decode-4k", f"decode tok/s at {ctx} tokens of context: int8 vs model dtype",
               "decode_tok_s")
        versus("kv-decode-4k", f"{ctx}-token sequences a {mem} pool holds: int8 vs model dtype",
               "seqs_fit")
    return rows


def build_kv_rows(summary: dict[str, dict[str, dict]]) -> list[Row]:
    """summary[workload][system] -> the KV workloads' rows (none for workloads not run)."""
    return tier_rows(summary) + int8_rows(summary)
