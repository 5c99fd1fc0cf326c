"""app/remote/metrics.py on /metrics texts of vLLM (recent and older names), SGLang and
llama.cpp's server: the values each fixture implies, worked out by hand (fixtures/README.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.remote.metrics import (
    CANONICAL,
    MetricsError,
    detect_kind,
    hit_rate,
    parse_scrape,
    rate,
    window_quantiles,
)

FIXTURES = Path(__file__).parent / "fixtures"
DT = 2.0


def scrapes(name: str):
    first = parse_scrape((FIXTURES / f"{name}.1.prom").read_text(), now=100.0)
    second = parse_scrape((FIXTURES / f"{name}.2.prom").read_text(), now=100.0 + DT)
    return first, second


def test_vllm_v1_two_engines() -> None:
    a, b = scrapes("vllm_v1")
    assert b.kind == "vllm" and b.ranks == ["engine=0", "engine=1"]
    assert b.total("running") == 5 and b.total("waiting") == 3
    assert b.values["running"] == {"engine=0": 4.0, "engine=1": 1.0}  # the per-rank view
    assert b.total("kv_usage") == pytest.approx(0.30)  # mean of 0.25 and 0.35
    assert hit_rate(a, b) == pytest.approx(500 / 1000)
    assert rate(a, b, "prompt_tokens") == pytest.approx(2000 / DT)
    assert rate(a, b, "generation_tokens") == pytest.approx(400 / DT)
    assert rate(a, b, "preemptions") == pytest.approx(2 / DT)
    ttft = window_quantiles(a, b, "ttft")
    assert ttft == pytest.approx({0.5: 0.06, 0.9: 0.08, 0.99: 0.25 + 0.25 * 0.9})
    itl = window_quantiles(a, b, "itl")
    assert itl == pytest.approx({0.5: 0.025, 0.9: 0.05, 0.99: 0.05 + 0.025 * 0.9})
    assert b.num_blocks == 27000 and b.cache_info["block_size"] == "16"
    assert b.missing == []


def test_vllm_older_names() -> None:
    a, b = scrapes("vllm_v0")
    assert b.kind == "vllm" and b.ranks == [""]
    assert (b.total("running"), b.total("waiting"), b.total("kv_usage")) == (6, 0, 0.6)
    assert hit_rate(a, b) == pytest.approx(50 / 200)
    assert rate(a, b, "prompt_tokens") == pytest.approx(600 / DT)
    # ten new observations at 0.03 s, all in (0.025, 0.05]
    itl = window_quantiles(a, b, "itl")
    assert itl == pytest.approx({q: 0.025 + 0.025 * q for q in (0.5, 0.9, 0.99)})
    assert set(b.missing) == {"ttft", "preemptions"}
    assert window_quantiles(a, b, "ttft") is None


def test_sglang_two_data_parallel_ranks() -> None:
    a, b = scrapes("sglang")
    assert b.kind == "sglang"
    assert b.ranks == ["dp_rank=0,tp_rank=0,pp_rank=0", "dp_rank=1,tp_rank=0,pp_rank=0"]
    assert (b.total("running"), b.total("waiting")) == (8, 2)
    assert b.total("kv_usage") == pytest.approx(0.3)
    assert hit_rate(a, b) == pytest.approx(400 / 1000)  # cached over prompt tokens
    assert rate(a, b, "generation_tokens") == pytest.approx(500 / DT)
    ttft = window_quantiles(a, b, "ttft")
    assert ttft == pytest.approx({0.5: 0.1 + 0.15 * 5 / 8, 0.9: 0.875, 0.99: 0.75 + 0.25 * 0.95})
    assert b.capacity_tokens == 161721
    assert set(b.missing) == {"itl", "preemptions"}


def test_llamacpp_reports_no_prefix_cache_and_no_histograms() -> None:
    a, b = scrapes("llamacpp")
    assert b.kind == "llamacpp"
    assert (b.total("running"), b.total("waiting")) == (2, 3)
    assert rate(a, b, "prompt_tokens") == pytest.approx(300 / DT)
    assert rate(a, b, "generation_tokens") == pytest.approx(600 / DT)
    assert set(b.missing) == {"kv_usage", "prefix_queries", "prefix_hits", "preemptions",
                              "ttft", "itl"}  # fmt: skip
    assert hit_rate(a, b) is None and b.total("kv_usage") is None


def test_counter_reset_counts_from_zero() -> None:
    a, _ = scrapes("llamacpp")
    restarted = parse_scrape("llamacpp:tokens_predicted_total 30\n", now=100.0 + DT)
    assert rate(a, restarted, "generation_tokens") == pytest.approx(30 / DT)


def test_detection_and_bad_input() -> None:
    assert detect_kind("") == "unknown"
    assert detect_kind("", owned_by="vllm") == "vllm"
    assert detect_kind("kvscope:num_requests_running 1\n") == "kvscope"
    with pytest.raises(MetricsError):
        parse_scrape('vllm:num_requests_running{model_name="x" 1\n', now=0)
    with pytest.raises(MetricsError):
        parse_scrape("#" * (9 << 20), now=0)
    assert parse_scrape("garbage without prefix\n", now=0).missing == list(CANONICAL)
