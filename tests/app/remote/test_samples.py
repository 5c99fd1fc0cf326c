"""app/remote/samples.py: what the window draws from a series of scrapes, against the values the
fixtures imply (worked out by hand in fixtures/README.md and test_metrics.py) and against
brute-force sums over synthetic scrapes."""

from __future__ import annotations

import pytest

from app.remote.metrics import parse_scrape
from app.remote.samples import ScrapeWindow
from tests.app.remote.fake_server import fixture_texts

DT = 2.0


def two_samples(name: str):
    w = ScrapeWindow(window_s=10.0)
    first, second = fixture_texts(name)
    a = w.add(parse_scrape(first, now=100.0))
    b = w.add(parse_scrape(second, now=100.0 + DT))
    return a, b


def test_first_sample_has_gauges_but_no_rates_and_nothing_missing_by_mistake() -> None:
    a, b = two_samples("vllm_v1")
    assert (a.running, a.waiting, a.kv_usage) == (5.0, 1.0, pytest.approx(0.3))
    assert a.window_s == 0 and a.prompt_tps is None and a.hit_rate is None and a.ttft is None
    assert a.missing == [] and a.reported("ttft")  # reported, just nothing to say yet
    assert b.window_s == DT


def test_vllm_two_engines_totals_and_per_rank() -> None:
    _, b = two_samples("vllm_v1")
    assert (b.running, b.waiting) == (5.0, 3.0) and b.kv_usage == pytest.approx(0.30)
    assert b.hit_rate == pytest.approx(0.5)
    assert (b.prompt_tps, b.gen_tps, b.preemptions_per_s) == pytest.approx((1000, 200, 1))
    assert b.ttft == pytest.approx({0.5: 0.06, 0.9: 0.08, 0.99: 0.475})
    assert b.itl == pytest.approx({0.5: 0.025, 0.9: 0.05, 0.99: 0.0725})
    assert (b.num_blocks, b.block_size) == (27000, 16)
    e0, e1 = b.ranks["engine=0"], b.ranks["engine=1"]
    # engine 0: prompt 5000 -> 6200, generation 2000 -> 2300, queries 1000 -> 1600, hits 400 -> 700
    assert (e0.running, e0.waiting, e0.kv_usage) == (4.0, 2.0, 0.25)
    assert (e0.prompt_tps, e0.gen_tps, e0.hit_rate) == pytest.approx((600, 150, 300 / 600))
    # engine 1: prompt 3000 -> 3800, generation 1000 -> 1100, queries 500 -> 900, hits 100 -> 300
    assert (e1.prompt_tps, e1.gen_tps, e1.hit_rate) == pytest.approx((400, 50, 200 / 400))
    assert sum(r.prompt_tps for r in b.ranks.values()) == pytest.approx(b.prompt_tps)


def test_sglang_ranks_and_capacity() -> None:
    _, b = two_samples("sglang")
    assert sorted(b.ranks) == ["dp_rank=0,tp_rank=0,pp_rank=0", "dp_rank=1,tp_rank=0,pp_rank=0"]
    assert [b.ranks[r].kv_usage for r in sorted(b.ranks)] == [0.2, 0.4]
    assert b.capacity_tokens == 161721 and b.num_blocks is None
    assert b.hit_rate == pytest.approx(0.4) and b.itl is None
    assert set(b.missing) == {"itl", "preemptions"}


def test_llamacpp_missing_is_none_and_named() -> None:
    _, b = two_samples("llamacpp")
    assert (b.running, b.waiting, b.prompt_tps, b.gen_tps) == (2, 3, 150, 300)
    for name, value in (("kv_usage", b.kv_usage), ("ttft", b.ttft), ("itl", b.itl),
                        ("preemptions", b.preemptions_per_s)):
        assert value is None and name in b.missing
    assert b.hit_rate is None and b.ranks[""].hit_rate is None


def _counter(n: float) -> str:
    return f"vllm:generation_tokens_total {n}\nvllm:num_requests_running 1\n"


def test_the_window_slides_and_starts_over_for_another_server() -> None:
    w = ScrapeWindow(window_s=4.0)
    counts = [0, 10, 30, 60, 100, 150, 210]  # scraped once a second
    samples = [w.add(parse_scrape(_counter(c), now=float(t))) for t, c in enumerate(counts)]
    # the rate covers the oldest scrape still within a full window: brute force over the list
    for t, s in enumerate(samples[1:], start=1):
        start = max(0, t - 4)
        assert s.window_s == t - start
        assert s.gen_tps == pytest.approx((counts[t] - counts[start]) / (t - start))
    # a clock that goes back (another process behind the URL) starts the window over
    again = w.add(parse_scrape(_counter(5), now=1.0))
    assert again.window_s == 0 and again.gen_tps is None
    # so does another kind of server
    w.add(parse_scrape(_counter(7), now=2.0))
    other = w.add(parse_scrape("sglang:generation_tokens_total 9\n", now=3.0))
    assert other.kind == "sglang" and other.window_s == 0


def test_counter_reset_inside_the_window() -> None:
    w = ScrapeWindow(window_s=10.0)
    w.add(parse_scrape(_counter(1000), now=0.0))
    s = w.add(parse_scrape(_counter(40), now=2.0))  # restarted: counts from zero
    assert s.gen_tps == pytest.approx(40 / 2)


def test_bad_window() -> None:
    with pytest.raises(ValueError, match="window_s"):
        ScrapeWindow(window_s=0)
