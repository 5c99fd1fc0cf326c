"""Prometheus text from vLLM, SGLang, llama.cpp's server or KVScope -> one vocabulary of
numbers the window draws, and the rates and quantiles between two scrapes.

Each server names the same quantity differently (and renamed some between releases); this module
maps them to canonical names, sums data-parallel / tensor-parallel ranks (vLLM's `engine` label,
SGLang's `tp_rank` / `dp_rank` / `pp_rank`) while keeping the per-rank values, and reports what a
server does not export as missing, never as zero. Where the names come from:
../shared/docs/INTERFACES.md.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

KINDS = ("kvscope", "vllm", "sglang", "llamacpp")
RANK_LABELS = ("engine", "dp_rank", "tp_rank", "pp_rank")
MAX_METRICS_BYTES = 8 << 20  # a bigger /metrics answer is refused, not parsed

# canonical name -> (type, {kind: source names without prefix, first found wins})
_VLLM_LIKE = ("kvscope", "vllm")
SOURCES: dict[str, tuple[str, dict[str, tuple[str, ...]]]] = {
    "running": ("gauge", {
        **dict.fromkeys(_VLLM_LIKE, ("num_requests_running",)),
        "sglang": ("num_running_reqs",), "llamacpp": ("requests_processing",)}),
    "waiting": ("gauge", {
        **dict.fromkeys(_VLLM_LIKE, ("num_requests_waiting",)),
        "sglang": ("num_queue_reqs",), "llamacpp": ("requests_deferred",)}),
    "kv_usage": ("gauge", {
        **dict.fromkeys(_VLLM_LIKE, ("kv_cache_usage_perc", "gpu_cache_usage_perc")),
        "sglang": ("token_usage",), "llamacpp": ("kv_cache_usage_ratio",)}),
    "prefix_queries": ("counter", {
        **dict.fromkeys(_VLLM_LIKE, ("prefix_cache_queries", "gpu_prefix_cache_queries")),
        # SGLang counts cached prompt tokens among all prompt tokens
        "sglang": ("prompt_tokens",)}),
    "prefix_hits": ("counter", {
        **dict.fromkeys(_VLLM_LIKE, ("prefix_cache_hits", "gpu_prefix_cache_hits")),
        "sglang": ("cached_tokens",)}),
    "prompt_tokens": ("counter", {
        **dict.fromkeys(_VLLM_LIKE, ("prompt_tokens",)),
        "sglang": ("prompt_tokens",), "llamacpp": ("prompt_tokens",)}),
    "generation_tokens": ("counter", {
        **dict.fromkeys(_VLLM_LIKE, ("generation_tokens",)),
        "sglang": ("generation_tokens",), "llamacpp": ("tokens_predicted",)}),
    "preemptions": ("counter", {
        **dict.fromkeys(_VLLM_LIKE, ("num_preemptions",)), "sglang": ("num_retracted_reqs",)}),
    "ttft": ("histogram", {
        **dict.fromkeys(_VLLM_LIKE + ("sglang",), ("time_to_first_token_seconds",))}),
    "itl": ("histogram", {
        **dict.fromkeys(_VLLM_LIKE + ("sglang",),
                        ("inter_token_latency_seconds", "time_per_output_token_seconds"))}),
}  # fmt: skip
CANONICAL = tuple(SOURCES)


class MetricsError(ValueError):
    """A /metrics answer that cannot be read (too big, not Prometheus text)."""


@dataclass(slots=True)
class HistogramValue:
    bounds: list[float]  # finite upper bounds, increasing
    cumulative: list[float]  # per bound, then +Inf last (len(bounds) + 1)
    sum: float = 0.0

    @property
    def count(self) -> float:
        return self.cumulative[-1] if self.cumulative else 0.0

    def plus(self, other: HistogramValue) -> HistogramValue:
        if other.bounds != self.bounds:  # ranks with other buckets: keep the common ones
            return self
        return HistogramValue(
            self.bounds, [a + b for a, b in zip(self.cumulative, other.cumulative, strict=True)],
            self.sum + other.sum,
        )  # fmt: skip


Rank = str  # "" for unlabelled series, else e.g. "engine=1" or "dp_rank=0,tp_rank=1"


@dataclass(slots=True)
class Scrape:
    """One /metrics answer in canonical names, per rank."""

    time: float
    kind: str
    values: dict[str, dict[Rank, float | HistogramValue]] = field(default_factory=dict)
    cache_info: dict[str, str] = field(default_factory=dict)  # vLLM/KVScope cache_config_info
    capacity_tokens: float | None = None  # SGLang's max_total_num_tokens

    def reported(self, name: str) -> bool:
        return bool(self.values.get(name))

    def total(self, name: str) -> float | None:
        """Summed over ranks (KV usage: the mean); None when not reported."""
        per_rank = self.values.get(name)
        if not per_rank:
            return None
        vals = [v for v in per_rank.values() if isinstance(v, float)]
        if not vals:
            return None
        return sum(vals) / len(vals) if name == "kv_usage" else sum(vals)

    def histogram(self, name: str) -> HistogramValue | None:
        per_rank = self.values.get(name)
        if not per_rank:
            return None
        hists = [v for v in per_rank.values() if isinstance(v, HistogramValue)]
        out = hists[0] if hists else None
        for h in hists[1:]:
            out = out.plus(h)
        return out

    @property
    def ranks(self) -> list[Rank]:
        found = {r for per_rank in self.values.values() for r in per_rank}
        return sorted(found)

    @property
    def missing(self) -> list[str]:
        return [name for name in CANONICAL if not self.reported(name)]

    @property
    def num_blocks(self) -> int | None:
        raw = self.cache_info.get("num_gpu_blocks")
        return int(float(raw)) if raw not in (None, "", "None") else None


def detect_kind(text: str, owned_by: str | None = None) -> str:
    """The server kind from the metric prefixes (most samples wins), else from /v1/models'
    `owned_by`; "unknown" when neither says."""
    counts = {kind: text.count(f"\n{kind}:") + text.startswith(f"{kind}:") for kind in KINDS}
    best = max(counts, key=lambda k: counts[k])
    if counts[best]:
        return best
    owner = (owned_by or "").lower().replace(".", "").replace("-", "")
    for kind in KINDS:
        if kind in owner:
            return kind
    return "unknown"


def parse_scrape(text: str, now: float, kind: str | None = None) -> Scrape:
    if len(text) > MAX_METRICS_BYTES:
        raise MetricsError(f"/metrics is {len(text)} bytes; the limit is {MAX_METRICS_BYTES}")
    kind = kind or detect_kind(text)
    scrape = Scrape(time=now, kind=kind)
    if kind not in KINDS:
        return scrape
    prefix = kind + ":"
    wanted = _wanted_names(kind)
    # canonical -> source -> rank -> value (histograms: their parts), resolved below
    raw: dict[str, dict[str, dict[Rank, object]]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name.startswith(prefix):
                    _take(scrape, wanted, s.name[len(prefix) :], s.labels, float(s.value), raw)
    except (ValueError, TypeError, IndexError) as exc:
        raise MetricsError(f"/metrics is not Prometheus text: {exc}") from None
    for canon, by_source in raw.items():
        # The first-listed name present wins (a server may export a new and an old name).
        source = next(src for src in SOURCES[canon][1][kind] if src in by_source)
        per_rank = by_source[source]
        if SOURCES[canon][0] == "histogram":
            hists = {r: _histogram_of(parts) for r, parts in per_rank.items()}  # type: ignore[arg-type]
            scrape.values[canon] = {r: h for r, h in hists.items() if h is not None}
        else:
            scrape.values[canon] = dict(per_rank)  # type: ignore[arg-type]
    return scrape


def _wanted_names(kind: str) -> dict[str, list[tuple[str, str]]]:
    """source name -> [(canonical, type)] (SGLang's prompt_tokens feeds two)."""
    out: dict[str, list[tuple[str, str]]] = {}
    for canon, (typ, by_kind) in SOURCES.items():
        for source in by_kind.get(kind, ()):
            out.setdefault(source, []).append((canon, typ))
    return out


def _rank_of(labels: dict[str, str]) -> Rank:
    return ",".join(f"{k}={labels[k]}" for k in RANK_LABELS if k in labels)


def _take(
    scrape: Scrape,
    wanted: dict[str, list[tuple[str, str]]],
    name: str,
    labels: dict[str, str],
    value: float,
    raw: dict[str, dict[str, dict[Rank, object]]],
) -> None:
    if name == "cache_config_info":
        scrape.cache_info = dict(labels)
        return
    if name == "max_total_num_tokens":
        scrape.capacity_tokens = value
        return
    rank = _rank_of(labels)
    for suffix in ("_bucket", "_sum", "_count"):
        if name.endswith(suffix) and name[: -len(suffix)] in wanted:
            base = name[: -len(suffix)]
            for canon, typ in wanted[base]:
                if typ == "histogram":
                    parts = (
                        raw.setdefault(canon, {})
                        .setdefault(base, {})
                        .setdefault(rank, {"buckets": {}})
                    )
                    if suffix == "_bucket":
                        parts["buckets"][_le(labels.get("le", "+Inf"))] = value  # type: ignore[index]
                    else:
                        parts[suffix] = value  # type: ignore[index]
            return
    base = name[:-6] if name.endswith("_total") else name
    for canon, typ in wanted.get(base, ()):
        if typ != "histogram":
            per_rank = raw.setdefault(canon, {}).setdefault(base, {})
            per_rank[rank] = per_rank.get(rank, 0.0) + value  # type: ignore[operator]


def _le(raw: str) -> float:
    return math.inf if raw in ("+Inf", "Inf", "inf") else float(raw)


def _histogram_of(parts: dict[str, object]) -> HistogramValue | None:
    buckets: dict[float, float] = parts["buckets"]  # type: ignore[assignment]
    if not buckets:
        return None
    bounds = sorted(b for b in buckets if math.isfinite(b))
    total = buckets.get(math.inf, buckets[bounds[-1]] if bounds else 0.0)
    return HistogramValue(
        bounds, [buckets[b] for b in bounds] + [total], float(parts.get("_sum", 0.0))
    )  # type: ignore[arg-type]


# ------------------------------------------------------------------ between two scrapes


def counter_delta(old: float, new: float) -> float:
    """Prometheus' rule: a counter that went down was reset; count from zero."""
    return new - old if new >= old else new


def rate(old: Scrape, new: Scrape, name: str) -> float | None:
    a, b = old.total(name), new.total(name)
    dt = new.time - old.time
    if a is None or b is None or dt <= 0:
        return None
    return counter_delta(a, b) / dt


def hit_rate(old: Scrape, new: Scrape) -> float | None:
    """Prefix-cache hits over queries between the scrapes; None without queries."""
    q0, q1 = old.total("prefix_queries"), new.total("prefix_queries")
    h0, h1 = old.total("prefix_hits"), new.total("prefix_hits")
    if None in (q0, q1, h0, h1):
        return None
    dq = counter_delta(q0, q1)  # type: ignore[arg-type]
    return counter_delta(h0, h1) / dq if dq > 0 else None  # type: ignore[arg-type]


def histogram_delta(old: HistogramValue | None, new: HistogramValue) -> HistogramValue:
    if old is None or old.bounds != new.bounds or new.count < old.count:
        return new
    return HistogramValue(
        new.bounds, [b - a for a, b in zip(old.cumulative, new.cumulative, strict=True)],
        new.sum - old.sum,
    )  # fmt: skip


def quantile(h: HistogramValue, q: float) -> float | None:
    """Prometheus' histogram_quantile: linear inside the bucket that holds the q-th
    observation; the highest finite bound when it falls in +Inf; None without observations."""
    total = h.count
    if total <= 0 or not h.bounds:
        return None
    rank = q * total
    i = bisect.bisect_left(h.cumulative, rank)
    if i >= len(h.bounds):
        return h.bounds[-1]
    lower = 0.0 if i == 0 else h.bounds[i - 1]
    below = 0.0 if i == 0 else h.cumulative[i - 1]
    in_bucket = h.cumulative[i] - below
    if in_bucket <= 0:
        return h.bounds[i]
    return lower + (h.bounds[i] - lower) * (rank - below) / in_bucket


def window_quantiles(
    old: Scrape, new: Scrape, name: str, qs: Iterable[float] = (0.5, 0.9, 0.99)
) -> dict[float, float | None] | None:
    """Quantiles of the observations made between two scrapes; None when not reported."""
    h_new = new.histogram(name)
    if h_new is None:
        return None
    delta = histogram_delta(old.histogram(name), h_new)
    return {q: quantile(delta, q) for q in qs}
