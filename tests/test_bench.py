"""app.bench and its modules (workloads, statistics, the table) and engine_proc.bench_worker (one
real run on a tiny random model). The front-end systems (app.bench_clients):
test_bench_clients.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from app.bench_stats import (
    ideal_paged_occupancy,
    interference_stats,
    percentile,
    summarize_workload,
)
from app.bench_table import build_rows, format_table
from app.bench_workloads import FULL, QUICK, WORKLOADS, Vocab, make_workload

REPO = Path(__file__).resolve().parent.parent
VOCAB = Vocab(49152, list(range(17)))
TINY = replace(
    QUICK, mixed_n=5, mixed_prompt=(3, 40), mixed_out=(2, 6), shared_n=3, shared_prefix=32,
    shared_user=5, shared_out=2, interf_streams=2, interf_long=40, interf_chunk=8,
    interf_warm=2, interf_tail=2, prefill_len=20, single_prompt=8, single_new=4,
)


# ------------------------------------------------------------------------------- workloads


@pytest.mark.parametrize("name", WORKLOADS)
def test_workload_is_deterministic_per_seed(name: str) -> None:
    a = make_workload(name, QUICK, 7, VOCAB)
    b = make_workload(name, QUICK, 7, VOCAB)
    c = make_workload(name, QUICK, 8, VOCAB)
    assert json.dumps(a) == json.dumps(b)
    assert [r["prompt"] for r in a["requests"]] != [r["prompt"] for r in c["requests"]]
    for r in a["requests"]:
        assert all(17 <= t < 49152 for t in r["prompt"])
        assert r["max_tokens"] >= 1


def test_workload_shapes_follow_sizes() -> None:
    s = QUICK
    mixed = make_workload("mixed", s, 0, VOCAB)["requests"]
    poisson = make_workload("mixed-poisson", s, 0, VOCAB)["requests"]
    assert len(mixed) == s.mixed_n
    assert all(s.mixed_prompt[0] <= len(r["prompt"]) <= s.mixed_prompt[1] for r in mixed)
    assert all(s.mixed_out[0] <= r["max_tokens"] <= s.mixed_out[1] for r in mixed)
    assert [r["prompt"] for r in mixed] == [r["prompt"] for r in poisson]
    arrivals = [r["arrival_s"] for r in poisson]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0 and arrivals[-1] > 0
    shared = make_workload("shared-prefix", s, 0, VOCAB)["requests"]
    prefix = shared[0]["prompt"][: s.shared_prefix]
    assert len(shared) == s.shared_n
    assert all(r["prompt"][: s.shared_prefix] == prefix for r in shared)
    assert len({tuple(r["prompt"][s.shared_prefix:]) for r in shared}) == s.shared_n
    single = make_workload("single", s, 0, VOCAB)["requests"]
    assert [(len(r["prompt"]), r["max_tokens"]) for r in single] == [(s.single_prompt,
                                                                     s.single_new)]


@pytest.mark.parametrize("sizes", [QUICK, FULL])
def test_streaming_workload_is_concurrent_streams(sizes) -> None:
    w = make_workload("streaming", sizes, 0, VOCAB)
    reqs = w["requests"]
    assert len(reqs) == sizes.streams_n == 32
    assert all(r["arrival_s"] == 0.0 and "after" not in r for r in reqs)  # all at once
    lo, hi = sizes.streams_prompt
    assert all(lo <= len(r["prompt"]) <= hi for r in reqs) and lo <= 64 <= hi
    assert len({len(r["prompt"]) for r in reqs}) > 1  # drawn, like the mixed workload's
    assert all(r["max_tokens"] == sizes.streams_out for r in reqs)
    assert len({tuple(r["prompt"]) for r in reqs}) == len(reqs)
    assert w["engine"] == {}  # both front-ends get the engine's plain serve options
    warm = w["meta"]["warmup_prompt"]
    assert 0 < len(warm) < 16  # under one KV block: the warm-up leaves no prefix to hit
    assert all(17 <= t < 49152 for t in warm)
    assert FULL.streams_out == 128 and QUICK.streams_out < FULL.streams_out


# ------------------------------------------------------------------------------- statistics


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


def test_rows_compute_ratios_and_verdicts() -> None:
    summary = {
        "single": {"kvscope": {"decode_tok_s": 30.0, "ttft_p50": 0.1},
                   "hf": {"decode_tok_s": 10.0, "ttft_p50": 0.3}},
        "prefill": {"kvscope": {"prefill_tok_s": 90.0}, "hf": {"prefill_tok_s": 100.0}},
        "mixed": {"kvscope": {"output_tok_s": 50.0, "total_tok_s": 300.0,
                              "paged_token_occupancy": 0.97,
                              "contiguous_max_len_occupancy": 0.05},
                  "hf": {"output_tok_s": 20.0, "total_tok_s": 100.0}},
        "shared-prefix": {"kvscope": {"ttft_p50": 0.05, "hits_of_shareable": 1.0},
                          "kvscope-nocache": {"ttft_p50": 0.5}},
        "interference": {"kvscope": {"itl_p99_over_median": 2.5},
                         "kvscope-nochunk": {"itl_p99_over_median": 40.0}},
    }
    ceilings = {"read_bw_gbs": 10.0, "fp32_matmul_gflops": 40.0, "bf16_matmul_gflops": 1.0,
                "model": {"weight_bytes": 500e6, "num_params": 100e6, "dtype": "float32"}}
    rows = {(r.section, r.metric): r for r in build_rows(summary, ceilings)}
    r = rows[("single", "decode tok/s (1/TPOT)")]
    assert (r.value, r.baseline, r.ratio, r.passed) == (30.0, 10.0, 3.0, True)
    r = rows[("single", "TTFT p50 s")]
    assert r.ratio == pytest.approx(3.0) and r.passed is None  # lower is better: 0.3 / 0.1
    r = rows[("single", "decode / (bandwidth / weight bytes)")]
    assert r.baseline == pytest.approx(20.0) and r.ratio == pytest.approx(1.5) and r.passed
    r = rows[("ceilings", "best tok/s (mixed) / (FLOP/s / 2P)")]
    assert r.value == 300.0 and r.baseline == pytest.approx(200.0)
    r = rows[("prefill", "prefill tok/s")]
    assert r.ratio == pytest.approx(0.9) and r.passed is False
    assert rows[("mixed", "output tok/s")].ratio == pytest.approx(2.5)
    assert rows[("mixed", "output tok/s")].passed is True
    r = rows[("shared-prefix", "TTFT p50 s (cache vs nocache)")]
    assert r.ratio == pytest.approx(10.0) and r.passed is True
    assert rows[("shared-prefix", "hits / shareable prompt tokens")].passed is True
    assert rows[("interference", "ITL p99 during long / median (kvscope)")].passed is True
    assert rows[("kv", "paged KV token occupancy")].passed is True
    # Workloads that were not run leave no rows.
    assert not any(section == "mixed-poisson" for section, _ in rows)
    summary["mixed-poisson"] = {"kvscope": {"output_tok_s": 5.0}}
    rows = {(r.section, r.metric): r for r in build_rows(summary, ceilings)}
    r = rows[("mixed-poisson", "output tok/s")]  # no baseline: no ratio, no verdict
    assert (r.value, r.ratio, r.passed) == (5.0, None, None)
    table = format_table(list(rows.values()))
    assert "3.00x" in table and "MISS" in table and "PASS" in table


def test_streaming_rows_compare_http_with_zeromq() -> None:
    summary = {"streaming": {"kvscope-zmq": {"output_tok_s": 100.0, "ttft_p50": 0.2,
                                             "itl_p50": 0.05, "streams": 32},
                             "kvscope-http": {"output_tok_s": 95.0, "ttft_p50": 0.25,
                                              "itl_p50": 0.05, "streams": 32}}}
    rows = {r.metric: r for r in build_rows(summary, None)}
    assert {r.section for r in rows.values()} == {"streaming"}  # nothing from other workloads
    r = rows["HTTP streaming, 32 streams: output tok/s vs ZeroMQ"]
    assert (r.value, r.baseline, r.baseline_name) == (95.0, 100.0, "kvscope-zmq")
    assert r.ratio == pytest.approx(0.95) and r.passed is True and r.target == ">= 0.9x kvscope-zmq"
    assert rows["HTTP vs ZeroMQ: TTFT p50 s"].ratio == pytest.approx(0.8)  # zmq / http
    summary["streaming"]["kvscope-http"]["output_tok_s"] = 85.0
    r = {r.metric: r for r in build_rows(summary, None)}[
        "HTTP streaming, 32 streams: output tok/s vs ZeroMQ"]
    assert r.ratio == pytest.approx(0.85) and r.passed is False
    summary["streaming"]["kvscope-http"] = {"error": "exit 1"}  # a failed system: no verdict
    r = {r.metric: r for r in build_rows(summary, None)}[
        "HTTP streaming, 32 streams: output tok/s vs ZeroMQ"]
    assert r.value is None and r.passed is None


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


def test_ideal_paged_occupancy_by_hand() -> None:
    # Lengths 15, 16, 17 with blocks of 16: 48 filled slots in 16 + 16 + 32 allocated.
    reqs = [{"prompt": [5] * 15, "max_tokens": 3}]
    assert ideal_paged_occupancy(reqs, 16) == pytest.approx(48 / 64)


# ------------------------------------------------------------------------------- the worker


def _run_worker(system: str, workload: dict, model: Path, tmp_path: Path) -> dict:
    path = tmp_path / f"{workload['name']}.json"
    path.write_text(json.dumps(workload))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", "engine_proc.bench_worker", "--system", system, "--workload",
         str(path), "--model", str(model), "--threads", "1", "--no-cache"],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check_sane(result: dict, workload: dict) -> None:
    reqs = workload["requests"]
    assert result["num_requests"] == len(reqs)
    assert result["prompt_tokens"] == sum(len(r["prompt"]) for r in reqs)
    assert result["output_tokens"] == sum(r["max_tokens"] for r in reqs)  # EOS is ignored
    by_id = {q["id"]: q for q in result["requests"]}
    for r in reqs:
        q = by_id[r["id"]]
        assert q["prompt_tokens"] == len(r["prompt"])
        assert q["output_tokens"] == r["max_tokens"] == len(q["itl"]) + 1
        assert all(x > 0 for x in q["itl"])
        assert q["ttft"] > 0 and q["e2e"] >= q["ttft"]
        assert q["token_times"] == sorted(q["token_times"])
    assert result["wall_s"] > 0 and result["output_tok_s"] > 0
    assert result["peak_rss_mb"] > 10


@pytest.mark.slow
def test_worker_runs_kvscope_on_a_tiny_model(tmp_path: Path) -> None:
    from tests.tiny_models import tiny_model_dir

    model = tiny_model_dir()
    mixed = make_workload("mixed", TINY, 3, VOCAB)
    result = _run_worker("kvscope", mixed, model, tmp_path)
    _check_sane(result, mixed)
    assert result["system"] == "kvscope" and result["num_preemptions"] == 0
    kv = result["kv"]
    assert 0 < kv["paged_token_occupancy"] <= 1
    assert kv["contiguous_max_len_occupancy"] < kv["paged_token_occupancy"]

    shared = make_workload("shared-prefix", TINY, 3, VOCAB)
    result = _run_worker("kvscope", shared, model, tmp_path)
    _check_sane(result, shared)
    # Chats arrive one after another: every chat after the first hits the whole prefix (its
    # length is a multiple of the block size), and nothing else.
    assert result["prefix_cache_hits"] == (TINY.shared_n - 1) * TINY.shared_prefix
    summary = summarize_workload("shared-prefix", [result], shared)
    assert summary["hits_of_shareable"] == pytest.approx(1.0)


def test_app_bench_does_not_import_torch() -> None:
    code = ("import sys, app.bench, app.bench_clients, ipc.async_client, httpx; "
            "bad = [m for m in ('torch', 'transformers', 'engine_proc') "
            "if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO,
                   env=dict(os.environ, PYTHONPATH=str(REPO)))
