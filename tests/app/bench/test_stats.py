"""app.bench.stats: percentiles, interference, streaming and streams-N summaries, decode throughput
and ideal paged occupancy, each checked against numbers worked out by hand."""

from __future__ import annotations

import numpy as np
import pytest

from app.bench.stats import (
    decode_throughput,
    ideal_paged_occupancy,
    interference_stats,
    percentile,
    summarize_workload,
)
from app.bench.table import streams_header
from app.bench.workloads import Sizes


def test_percentile_matches_numpy() -> None:
    rng = np.random.default_rng(0)
    xs = list(rng.exponential(size=37))
    for q in (0, 1, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert percentile([], 50) is None


def test_interference_stats_by_hand() -> None:
    # Stream d0 ticks every 0.1 s, except one 0.5 s gap while the long prompt (arrival 0.25,
    # first token 0.8) is prefilled.
    times = [0.0, 0.1, 0.2, 0.3, 0.8, 0.9, 1.0]
    run = {"requests": [
        {"id": "d0", "token_times": times},
        {"id": "long", "arrival": 0.25, "token_times": [0.8]},
    ]}
    s = interference_stats(run)
    assert s["itl_during_count"] == 2  # 0.2->0.3 and 0.3->0.8 end inside (0.25, 0.8]
    assert s["itl_median"] == pytest.approx(0.1)
    assert s["itl_p99_during"] == pytest.approx(0.1 + 0.99 * 0.4)
    assert s["p99_over_median"] == pytest.approx((0.1 + 0.99 * 0.4) / 0.1)


def test_streaming_summary_by_hand() -> None:
    workload = {"requests": [{"id": "s0"}, {"id": "s1"}]}

    def run(out_tok_s: float, cpu: dict[str, float]) -> dict:
        q = {"ttft": 0.5, "tpot": 0.1, "e2e": 1.0, "itl": [0.1, 0.1]}
        return {"output_tok_s": out_tok_s, "output_tokens": 2000, "wall_s": 20.0,
                "cpu_s": cpu, "requests": [q, q]}

    runs = [run(90.0, {"engine": 10.0, "server": 1.0, "client": 1.0}),
            run(100.0, {"engine": 20.0, "server": 2.0, "client": 2.0}),
            {"error": "exit 1"}]  # a failed repeat counts for nothing
    s = summarize_workload("streaming", runs, workload)
    assert s["runs"] == 2 and s["streams"] == 2 and s["output_tok_s"] == pytest.approx(95.0)
    assert s["cpu_s"] == {"client": 1.5, "engine": 15.0, "server": 1.5}
    # (1 + 1) s over 2000 tokens and (2 + 2) s over 2000 tokens: 1 and 2 ms per token
    assert s["frontend_cpu_ms_per_token"] == pytest.approx(1.5)
    assert s["engine_cpu_share"] == pytest.approx((10 / 20 + 20 / 20) / 2)


def test_streams_decode_throughput_by_hand() -> None:
    # Two streams: first tokens at 1.0 and 1.2, last tokens at 2.0 and 2.2, 5 tokens each:
    # 8 decoded tokens over 1.2 s.
    run = {"requests": [{"token_times": [1.0, 1.25, 1.5, 1.75, 2.0], "ttft": 1.0, "tpot": 0.25,
                         "e2e": 2.0, "itl": [0.25] * 4},
                        {"token_times": [1.2, 1.45, 1.7, 1.95, 2.2], "ttft": 1.2, "tpot": 0.25,
                         "e2e": 2.2, "itl": [0.25] * 4}],
           "model_info": {"decode_weights": "int4", "kv_cache_dtype": "fp16"},
           "decode_step": "fused", "decode_detail": "avx2_fp32+int8"}
    assert decode_throughput(run) == pytest.approx(8 / 1.2)
    one = {"requests": [run["requests"][0]]}
    assert decode_throughput(one) == pytest.approx(1 / 0.25)  # one stream: 1 / TPOT
    assert decode_throughput({"requests": [{"token_times": [1.0]}]}) is None
    slower = {"requests": [{**q, "token_times": [2 * t for t in q["token_times"]]}
                           for q in run["requests"]]}
    s = summarize_workload("streams-2", [run, slower, {"error": "exit 1"}],
                           {"requests": [{}, {}]})
    assert s["streams"] == 2 and s["runs"] == 2
    assert s["decode_tok_s"] == pytest.approx((8 / 1.2 + 8 / 2.4) / 2)  # median of two
    assert s["decode_weights"] == "int4" and s["kv_cache_dtype"] == "fp16"
    assert s["decode_step"] == "fused" and s["decode_detail"] == "avx2_fp32+int8"
    header = streams_header({"streams-2": {"kvscope": s, "kvscope-exact": {
        **s, "decode_detail": "avx2_fp32"}}}, Sizes())  # fmt: skip
    assert "fused step: kvscope avx2_fp32+int8; kvscope-exact avx2_fp32;" in header


def test_ideal_paged_occupancy_by_hand() -> None:
    # Lengths 15, 16, 17 with blocks of 16: 48 filled slots in 16 + 16 + 32 allocated.
    reqs = [{"prompt": [5] * 15, "max_tokens": 3}]
    assert ideal_paged_occupancy(reqs, 16) == pytest.approx(48 / 64)
