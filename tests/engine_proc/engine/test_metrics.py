"""engine_proc/engine/metrics.py: cumulative histograms against a brute-force recount."""

from __future__ import annotations

import random

import numpy as np
import pytest

from engine_proc import SamplingParams
from engine_proc.engine.metrics import (
    ITL_BUCKETS,
    Histogram,
    iteration_buckets,
    one_two_five_buckets,
)
from tests.engine_fixtures import tiny_engine


def recount(bounds, values) -> list[int]:
    """Per-bucket counts with Prometheus' 'less than or equal' rule, one value at a time."""
    counts = [0] * (len(bounds) + 1)
    for v in values:
        i = next((k for k, b in enumerate(bounds) if v <= b), len(bounds))
        counts[i] += 1
    return counts


def test_histogram_counts_equal_a_recount_including_values_on_bounds() -> None:
    rng = random.Random(0)
    values = [rng.uniform(0, 100) for _ in range(500)] + list(ITL_BUCKETS) + [0.0, 1e9]
    h = Histogram(ITL_BUCKETS)
    for v in values:
        h.observe(v)
    assert h.counts == recount(ITL_BUCKETS, values)
    assert h.sum == pytest.approx(sum(values))
    assert h.count == len(values)


def test_bucket_series() -> None:
    assert one_two_five_buckets(512) == (1, 2, 5, 10, 20, 50, 100, 200, 500)
    assert one_two_five_buckets(1000) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
    assert iteration_buckets(64) == (1, 8, 16, 32, 64)


def test_engine_histograms_recount_the_finished_requests() -> None:
    engine = tiny_engine(num_kv_blocks=64)
    prompts = [[5, 6, 7, 8, 9] * k for k in (1, 2, 3)]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (3, 7, 5)]
    outs = engine.generate(prompts, params)
    h = engine.histograms.by_name
    e2e = [o.metrics.e2e for o in outs]
    ttft = [o.metrics.ttft for o in outs]
    gaps = [g for o in outs for g in np.diff(o.metrics.token_times)]
    assert h["e2e_request_latency_seconds"].counts == recount(
        h["e2e_request_latency_seconds"].bounds, e2e
    )
    assert h["time_to_first_token_seconds"].sum == pytest.approx(sum(ttft))
    assert h["inter_token_latency_seconds"].count == len(gaps) == 2 + 6 + 4
    assert h["inter_token_latency_seconds"].sum == pytest.approx(sum(gaps))
    gen = h["request_generation_tokens"]
    assert gen.counts == recount(gen.bounds, [3, 7, 5]) and gen.sum == 15
    assert h["request_prompt_tokens"].sum == sum(len(p) for p in prompts)
    assert h["request_max_num_generation_tokens"].sum == 15
    assert engine.histograms.finished_reasons == {"length": 3}
    steps = h["iteration_tokens_total"]
    assert steps.sum == sum(len(p) for p in prompts) + 15 - 3  # last tokens are never computed
