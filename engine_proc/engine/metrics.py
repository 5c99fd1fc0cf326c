"""Cumulative latency and size histograms with vLLM's metric names and buckets.

The engine observes every sequence it finishes, whichever client sent it, and publishes the
running totals in each telemetry snapshot; a subscriber that loses snapshots still reads exact
totals, and the HTTP front-end renders them for Prometheus without seeing other clients' replies.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from engine_proc.core.request import Sequence

# vllm/v1/metrics/loggers.py
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


def one_two_five_buckets(limit: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's token-count buckets)."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(float(m * scale))
        scale *= 10


def iteration_buckets(limit: int = 16384) -> tuple[float, ...]:
    """1, 8, 16, 32, ... up to `limit` tokens per step."""
    out = [1.0]
    size = 8
    while size <= limit:
        out.append(float(size))
        size *= 2
    return tuple(out)


@dataclass(slots=True)
class Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # len(bounds) + 1, the last for +Inf
    sum: float = 0.0

    def __post_init__(self) -> None:
        assert list(self.bounds) == sorted(self.bounds), "bucket bounds must be increasing"
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        # Prometheus buckets are "less than or equal": bisect_left puts a value equal to a
        # bound into that bound's bucket.
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)


@dataclass(slots=True)
class RequestHistograms:
    """The engine's histograms by their names in `ipc.protocol.HISTOGRAM_NAMES`."""

    by_name: dict[str, Histogram]
    finished_reasons: dict[str, int] = field(default_factory=dict)

    @classmethod
    def create(cls, max_model_len: int, max_step_tokens: int = 16384) -> RequestHistograms:
        tokens = one_two_five_buckets(max_model_len)
        return cls(
            {
                "time_to_first_token_seconds": Histogram(TTFT_BUCKETS),
                "inter_token_latency_seconds": Histogram(ITL_BUCKETS),
                "e2e_request_latency_seconds": Histogram(REQUEST_LATENCY_BUCKETS),
                "request_queue_time_seconds": Histogram(REQUEST_LATENCY_BUCKETS),
                "request_prefill_time_seconds": Histogram(REQUEST_LATENCY_BUCKETS),
                "request_decode_time_seconds": Histogram(REQUEST_LATENCY_BUCKETS),
                "request_prompt_tokens": Histogram(tokens),
                "request_generation_tokens": Histogram(tokens),
                "request_max_num_generation_tokens": Histogram(tokens),
                "request_time_per_output_token_seconds": Histogram(ITL_BUCKETS),
                "iteration_tokens_total": Histogram(iteration_buckets(max_step_tokens)),
            }
        )

    def observe_finished(self, seq: Sequence) -> None:
        """Everything about one finished sequence (any finish reason)."""
        m = seq.metrics
        h = self.by_name
        self.finished_reasons[seq.finish_reason or "error"] = (
            self.finished_reasons.get(seq.finish_reason or "error", 0) + 1
        )
        if seq.index == 0:  # one per request, as vLLM counts prompts
            h["request_prompt_tokens"].observe(seq.num_prompt_tokens)
            h["request_max_num_generation_tokens"].observe(seq.params.max_tokens)
        if m.tpot is not None:
            h["request_time_per_output_token_seconds"].observe(m.tpot)
        h["request_generation_tokens"].observe(seq.num_output_tokens)
        if m.e2e is not None:
            h["e2e_request_latency_seconds"].observe(m.e2e)
        if m.queue_time is not None:
            h["request_queue_time_seconds"].observe(m.queue_time)
        if m.ttft is not None:
            h["time_to_first_token_seconds"].observe(m.ttft)
        if m.first_token_time is not None and m.first_scheduled_time is not None:
            h["request_prefill_time_seconds"].observe(m.first_token_time - m.first_scheduled_time)
        if m.first_token_time is not None and m.finished_time is not None:
            h["request_decode_time_seconds"].observe(m.finished_time - m.first_token_time)
        itl = h["inter_token_latency_seconds"]
        for gap in m.itl:
            itl.observe(gap)

    def observe_step(self, num_tokens: int) -> None:
        self.by_name["iteration_tokens_total"].observe(num_tokens)
