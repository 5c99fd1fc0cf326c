"""Telemetry snapshots -> Prometheus text, with vLLM v1's metric names, types, labels and buckets
under a `kvscope:` prefix (a vLLM Grafana dashboard works after swapping the prefix).

Every number comes from the engine's own cumulative counters and histograms, so the metrics cover
every request the engine serves (the window's, terminal chats', HTTP clients') and stay exact
when this process loses telemetry snapshots.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from ipc import protocol as P

PREFIX = "kvscope:"

# engine counter -> (metric name without prefix, help); Prometheus adds `_total` to counters
_COUNTERS = {
    "prefix_cache_queries": (
        "prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache.",
    ),
    "prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens served from the prefix cache."),
    "num_preemptions": (
        "num_preemptions",
        "Sequences preempted (their KV freed, recomputed later).",
    ),
    "request_prompt_tokens_total": ("prompt_tokens", "Prompt tokens of the requests received."),
    "generation_tokens_total": ("generation_tokens", "Tokens generated."),
    "external_prefix_cache_queries": (
        "external_prefix_cache_queries",
        "Prompt tokens looked up in the host/disk KV tiers (after missing the pool).",
    ),
    "external_prefix_cache_hits": (
        "external_prefix_cache_hits",
        "Prompt tokens loaded from the host/disk KV tiers instead of recomputed.",
    ),
    "spec_decode_num_drafts": (
        "spec_decode_num_drafts",
        "Speculative steps of a sequence (each verifies its drafts).",
    ),
    "spec_decode_num_draft_tokens": ("spec_decode_num_draft_tokens", "Draft tokens proposed."),
    "spec_decode_num_accepted_tokens": (
        "spec_decode_num_accepted_tokens",
        "Draft tokens the target model accepted.",
    ),
    "prompt_tokens_total": (
        "prompt_tokens_computed",
        "Prompt tokens run through the model (prefix-cache hits excluded; recomputation included).",
    ),
}

# Names older vLLM releases used (their Grafana dashboard still queries them).
_OLD_NAMES = {"inter_token_latency_seconds": "time_per_output_token_seconds"}

_HISTOGRAM_HELP = {
    "time_to_first_token_seconds": "Time from arrival to the first output token.",
    "inter_token_latency_seconds": "Time between two consecutive output tokens of a sequence.",
    "e2e_request_latency_seconds": "Time from arrival to finish, per sequence.",
    "request_queue_time_seconds": "Time from arrival to first being scheduled.",
    "request_prefill_time_seconds": "Time from first being scheduled to the first token.",
    "request_decode_time_seconds": "Time from the first token to finish.",
    "request_prompt_tokens": "Prompt length of finished requests.",
    "request_generation_tokens": "Generated tokens of finished sequences.",
    "request_max_num_generation_tokens": "max_tokens of finished requests.",
    "request_time_per_output_token_seconds": "Mean time per output token after the first, per "
    "finished sequence.",
    "iteration_tokens_total": "Tokens computed per engine step.",
}


_PER_POS = "spec_decode_num_accepted_tokens_per_pos"


def _accepted_per_pos(
    c: dict[str, float], labels: list[str], values: list[str]
) -> Iterator[Metric]:
    """vLLM's per-position acceptance counter, from the engine's `..._per_pos:<i>` keys."""
    keys = sorted((int(k.split(":")[1]), k) for k in c if k.startswith(_PER_POS + ":"))
    if not keys:
        return
    counter = CounterMetricFamily(
        PREFIX + _PER_POS, "Accepted draft tokens by their position among the drafts.",
        labels=[*labels, "position"],
    )  # fmt: skip
    for position, key in keys:
        counter.add_metric([*values, str(position)], c[key])
    yield counter


class TelemetryCollector:
    """A prometheus_client collector reading the newest snapshot at scrape time."""

    def __init__(self, source: Any, model_name: str) -> None:
        self.source = source  # has .telemetry (P.Telemetry | None) and .model_info (P.ModelInfo)
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        tel: P.Telemetry | None = self.source.telemetry
        if tel is None:
            return
        labels = ["model_name", "engine"]
        values = [self.model_name, "0"]
        c = tel.counters

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            g.add_metric(values, value)
            return g

        yield gauge("num_requests_running", "Sequences in the running batch.",
                    c.get("num_requests_running", 0))  # fmt: skip
        yield gauge("num_requests_waiting", "Sequences waiting to be scheduled.",
                    c.get("num_requests_waiting", 0))  # fmt: skip
        usage = c.get("kv_cache_usage_perc", 0.0)
        yield gauge("kv_cache_usage_perc", "Share of KV blocks in use (0..1).", usage)
        yield gauge("gpu_cache_usage_perc", "Deprecated name of kv_cache_usage_perc.", usage)
        for key, (name, doc) in _COUNTERS.items():
            if key in c:
                counter = CounterMetricFamily(PREFIX + name, doc, labels=labels)
                counter.add_metric(values, c[key])
                yield counter
        yield from _accepted_per_pos(c, labels, values)
        success = CounterMetricFamily(
            PREFIX + "request_success", "Finished sequences by finish reason.",
            labels=[*labels, "finished_reason"],
        )  # fmt: skip
        for reason in ("stop", "length", "abort", "error"):
            success.add_metric([*values, reason], tel.finished_reasons.get(reason, 0))
        yield success
        for name, h in tel.histograms.items():
            yield _histogram(PREFIX + name, _HISTOGRAM_HELP.get(name, name), labels, values, h)
            if name in _OLD_NAMES:  # what dashboards made for older vLLM releases query
                yield _histogram(PREFIX + _OLD_NAMES[name], "Deprecated name of " + name,
                                 labels, values, h)  # fmt: skip
        yield from self._kvscope_only(tel, labels, values)
        yield self._cache_config(tel)

    def _kvscope_only(
        self, tel: P.Telemetry, labels: list[str], values: list[str]
    ) -> Iterator[Metric]:
        c = tel.counters
        blocks = GaugeMetricFamily(
            PREFIX + "kv_blocks", "KV blocks by state: in_use (referenced), cached (free, holding "
            "a prefix hash), empty.", labels=[*labels, "state"],
        )  # fmt: skip
        for state in ("in_use", "cached", "empty"):
            blocks.add_metric([*values, state], c.get(f"num_blocks_{state}", 0))
        yield blocks
        occupancy = GaugeMetricFamily(
            PREFIX + "kv_token_occupancy_perc",
            "Filled share of the token slots of in-use blocks (0..1).", labels=labels,
        )  # fmt: skip
        occupancy.add_metric(values, c.get("kv_token_occupancy", 0.0))
        yield occupancy
        kv_bytes = GaugeMetricFamily(
            PREFIX + "kv_cache_bytes",
            "KV bytes: pool (all blocks), in_use (referenced blocks), contiguous_equivalent "
            "(what reserving max_model_len per running request would hold).",
            labels=[*labels, "kind"],
        )  # fmt: skip
        for kind, key in (("pool", "kv_pool_bytes"), ("in_use", "kv_bytes_in_use"),
                          ("contiguous_equivalent", "contiguous_kv_bytes")):  # fmt: skip
            kv_bytes.add_metric([*values, kind], c.get(key, 0))
        yield kv_bytes
        if "kv_blocks_full_attention" in c:  # a hybrid KV cache (sliding-window layers)
            groups = GaugeMetricFamily(
                PREFIX + "kv_group_blocks", "Blocks held by requests' tables, by the attention "
                "type of their layers: full_attention grows with the context, sliding_window "
                "stays within the window.", labels=[*labels, "attention"],
            )  # fmt: skip
            for kind in ("full_attention", "sliding_window"):
                groups.add_metric([*values, kind], c.get(f"kv_blocks_{kind}", 0))
            yield groups
        tiers = [t for t in ("host", "disk") if f"kv_{t}_blocks_total" in c]
        if tiers:
            tier_blocks = GaugeMetricFamily(
                PREFIX + "kv_tier_blocks", "Blocks held by each KV tier below the pool.",
                labels=[*labels, "tier"],
            )  # fmt: skip
            tier_hits = CounterMetricFamily(
                PREFIX + "kv_tier_hits", "Blocks loaded from each KV tier.",
                labels=[*labels, "tier"],
            )  # fmt: skip
            for t in tiers:
                tier_blocks.add_metric([*values, t], c.get(f"kv_{t}_blocks", 0))
                tier_hits.add_metric([*values, t], c.get(f"kv_{t}_hits", 0))
            yield tier_blocks
            yield tier_hits

    def _cache_config(self, tel: P.Telemetry) -> Metric:
        info = self.source.model_info
        config = {
            "block_size": str(info.block_size),
            "num_gpu_blocks": str(info.num_blocks),
            "cache_dtype": info.dtype,
            "enable_prefix_caching": str(tel.config.enable_prefix_caching),
            "kv_bytes_per_token": str(info.kv_bytes_per_token),
            "device": info.device,
        }
        g = GaugeMetricFamily(PREFIX + "cache_config_info", "KV cache configuration.",
                              labels=list(config))  # fmt: skip
        g.add_metric(list(config.values()), 1.0)
        return g


def _histogram(
    name: str, doc: str, labels: list[str], values: list[str], h: P.Histogram
) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=labels)
    cumulative = 0
    buckets = []
    for bound, count in zip(h.bounds, h.counts, strict=False):
        cumulative += count
        buckets.append((_bound_label(bound), cumulative))
    total = sum(h.counts)
    buckets.append(("+Inf", total))
    family.add_metric(values, buckets, sum_value=h.sum)
    return family


def _bound_label(bound: float) -> str:
    return repr(float(bound))


def render(source: Any, model_name: str) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(TelemetryCollector(source, model_name))
    return generate_latest(registry)
