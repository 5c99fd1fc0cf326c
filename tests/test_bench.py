"""app.bench and its modules (workloads, statistics, the table, plots), the driver's exit status
and paths (in-process, with fake workers), and engine_proc.bench_worker (one real run on a tiny
random model), and the whole CLI from another directory on a tiny GGUF. The front-end systems
(app.bench_clients): test_bench_clients.py; llama.cpp's batched runner: test_bench_llamacpp.py."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import app.bench as bench
from app.bench_plots import NO_PLOTS, write_plots
from app.bench_stats import (
    decode_throughput,
    ideal_paged_occupancy,
    interference_stats,
    percentile,
    summarize_workload,
)
from app.bench_table import build_rows, build_streams_rows, format_streams_table, format_table
from app.bench_workloads import (
    FULL,
    QUICK,
    STREAMS_WORKLOADS,
    WORKLOAD_SYSTEMS,
    WORKLOADS,
    Vocab,
    default_workloads,
    expand_workloads,
    make_workload,
)

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


@pytest.mark.parametrize("sizes", [QUICK, FULL])
def test_streams_workloads_are_n_identical_greedy_streams(sizes) -> None:
    assert STREAMS_WORKLOADS == ("streams-1", "streams-4", "streams-16", "streams-64")
    assert FULL.streams_levels == (1, 4, 16, 64) and QUICK.streams_levels == (1, 4, 16)
    assert FULL.streams_len == 29 and FULL.streams_new == 128 and QUICK.streams_new < 128
    prompts = []
    for n in (1, 4, 16, 64):
        w = make_workload(f"streams-{n}", sizes, 0, VOCAB)
        reqs = w["requests"]
        assert len(reqs) == n == w["meta"]["streams"] == w["hf_batch"]  # hf: one static batch
        assert all(r["arrival_s"] == 0.0 and "after" not in r for r in reqs)  # all at t=0
        assert all(len(r["prompt"]) == sizes.streams_len for r in reqs)
        assert all(r["max_tokens"] == sizes.streams_new for r in reqs)
        assert all("temperature" not in r for r in reqs)  # greedy
        assert len({tuple(r["prompt"]) for r in reqs}) == n
        # kvscope's CPU defaults, said so: 4-bit decode weights, the fused C++ decode step
        assert w["engine"] == {"decode_weights": "auto", "decode_step": "fused"}
        assert WORKLOAD_SYSTEMS[w["name"]] == ("kvscope", "hf", "llamacpp")
        prompts.append([r["prompt"] for r in reqs])
    for small, large in zip(prompts, prompts[1:], strict=False):
        assert large[: len(small)] == small  # every level serves the smaller levels' prompts


def test_streams_names_expand_with_the_sizes() -> None:
    assert expand_workloads(["streams"], FULL) == list(STREAMS_WORKLOADS)
    assert expand_workloads(["single", "streams", "streams-4"], QUICK) == [
        "single", "streams-1", "streams-4", "streams-16"]
    assert expand_workloads(["streams-64"], QUICK) == ["streams-64"]  # asked for by name
    assert default_workloads(QUICK)[-3:] == ["streams-1", "streams-4", "streams-16"]
    assert set(default_workloads(FULL)) == set(WORKLOADS)
    with pytest.raises(ValueError, match="streams-8"):
        expand_workloads(["streams-8"], FULL)


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
    assert not any(section == "streams-64" for section, _ in rows)  # not run
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
    # 64 streams against the better of the two matmul ceilings (here fp32: 40e9 / 2e8 = 200)
    summary["streams-64"] = {"kvscope": {"decode_tok_s": 90.0}}
    ceilings["bf16_matmul_gflops"] = 30.0
    rows = {(r.section, r.metric): r for r in build_rows(summary, ceilings)}
    r = rows[("streams-64", "decode tok/s / (best FLOP/s / 2P)")]
    assert r.baseline == pytest.approx(200.0) and r.ratio == pytest.approx(0.45) and not r.passed
    ceilings["bf16_matmul_gflops"] = 30.0
    summary["streams-64"]["kvscope"]["decode_tok_s"] = 100.0
    r = {(r.section, r.metric): r for r in build_rows(summary, ceilings)}[r.section, r.metric]
    assert r.ratio == pytest.approx(0.5) and r.passed is True


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


def test_streams_decode_throughput_by_hand() -> None:
    # Two streams: first tokens at 1.0 and 1.2, last tokens at 2.0 and 2.2, 5 tokens each:
    # 8 decoded tokens over 1.2 s.
    run = {"requests": [{"token_times": [1.0, 1.25, 1.5, 1.75, 2.0], "ttft": 1.0, "tpot": 0.25,
                         "e2e": 2.0, "itl": [0.25] * 4},
                        {"token_times": [1.2, 1.45, 1.7, 1.95, 2.2], "ttft": 1.2, "tpot": 0.25,
                         "e2e": 2.2, "itl": [0.25] * 4}],
           "model_info": {"decode_weights": "int4"}}
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
    assert s["decode_weights"] == "int4"


def test_streams_rows_have_both_ratios_and_the_issue_targets() -> None:
    def level(kv: float, llama: float | None, hf: float) -> dict:
        by = {"kvscope": {"decode_tok_s": kv}, "hf": {"decode_tok_s": hf}}
        by["llamacpp"] = {"decode_tok_s": llama} if llama else {"error": "exit 1"}
        return by

    summary = {"streams-64": level(500.0, 200.0, 100.0), "streams-1": level(20.0, 25.0, 10.0),
               "streams-4": level(60.0, 50.0, 30.0), "streams-16": level(150.0, None, 60.0),
               "single": {"kvscope": {"decode_tok_s": 20.0}}}
    rows = build_streams_rows(summary)
    assert [r.streams for r in rows] == [1, 4, 16, 64]  # by concurrency, not name
    one, four, sixteen, sixty_four = rows
    assert (one.vs_llamacpp, one.vs_hf) == (pytest.approx(0.8), pytest.approx(2.0))
    assert one.target == ">= 1x llama.cpp (moonshot)" and one.passed is False
    assert four.target == "" and four.passed is None and four.vs_llamacpp == pytest.approx(1.2)
    assert sixteen.llamacpp is None and sixteen.vs_llamacpp is None
    assert sixteen.target == ">= 2x llama.cpp" and sixteen.passed is None  # not measurable
    assert sixty_four.vs_llamacpp == pytest.approx(2.5) and sixty_four.passed is True
    table = format_streams_table(rows)
    lines = table.splitlines()
    assert len(lines) == 2 + 4 and "vs llama.cpp" in lines[0] and "vs transformers" in lines[0]
    assert lines[2].split()[:6] == ["1", "20.00", "25.00", "10.00", "0.80x", "2.00x"]
    assert lines[-1].endswith("PASS") and lines[2].endswith("MISS")
    # Other workloads' rows do not see the streams workloads, and vice versa.
    assert not any(r.section.startswith("streams") for r in build_rows(summary, None))
    assert build_streams_rows({"single": summary["single"]}) == []


def test_ideal_paged_occupancy_by_hand() -> None:
    # Lengths 15, 16, 17 with blocks of 16: 48 filled slots in 16 + 16 + 32 allocated.
    reqs = [{"prompt": [5] * 15, "max_tokens": 3}]
    assert ideal_paged_occupancy(reqs, 16) == pytest.approx(48 / 64)


# ------------------------------------------------------------------------------- the driver

CEILINGS = {"system": "ceilings", "read_bw_gbs": 10.0, "copy_bw_gbs": 10.0,
            "fp32_matmul_gflops": 40.0, "bf16_matmul_gflops": 1.0,
            "model": {"name": "fake", "num_params": 1e6, "weight_bytes": 4e6, "dtype": "float32",
                      "vocab_size": 49152, "special_ids": list(range(17)), "eos_token_ids": [2]}}


def _fake_result(system: str, workload_path: Path) -> dict:
    """What a worker that served every request of the workload would print."""
    reqs = json.loads(Path(workload_path).read_text())["requests"]
    rows = []
    for r in reqs:
        t = [0.5 + 0.1 * k for k in range(r["max_tokens"])]
        rows.append({"id": r["id"], "prompt_tokens": len(r["prompt"]), "output_tokens": len(t),
                     "ttft": t[0], "tpot": 0.1 if len(t) > 1 else None, "e2e": t[-1],
                     "itl": [0.1] * (len(t) - 1), "token_times": t})
    out = sum(r["max_tokens"] for r in reqs)
    return {"system": system, "wall_s": 1.0, "output_tok_s": float(out),
            "total_tok_s": float(out), "output_tokens": out, "requests": rows}


def _main_with(outcomes: dict[str, str], tmp_path: Path, monkeypatch, *extra: str) -> int:
    """app.bench.main on the single workload with fake workers: outcomes[system] is "ok",
    "error" or "skipped"."""
    def fake_run_worker(system, workload_path, args, timeout):
        if system == "ceilings":
            return dict(CEILINGS)
        kind = outcomes[system]
        if kind == "ok":
            return _fake_result(system, workload_path)
        return {"system": system, kind: f"{system} {kind} on purpose"}

    monkeypatch.setattr(bench, "run_worker", fake_run_worker)
    monkeypatch.setattr(bench, "llamacpp_installed", lambda: True)
    return bench.main(["--quick", "--workloads", "single", "--threads", "1", "--out",
                       str(tmp_path / "out"), "--log-level", "WARNING", *extra])


def test_a_run_whose_systems_all_failed_exits_1(tmp_path: Path, monkeypatch, capsys) -> None:
    failed = {"kvscope": "error", "kvscope-int4": "error", "hf": "error"}
    assert _main_with(failed | {"llamacpp": "skipped"}, tmp_path, monkeypatch) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: every system that ran failed (3 run(s))")
    # A skipped system is no failure, and one system that ran is enough.
    assert _main_with(failed | {"llamacpp": "ok"}, tmp_path, monkeypatch) == 0
    everything_ok = dict.fromkeys(failed, "ok") | {"llamacpp": "skipped"}
    assert _main_with(everything_ok, tmp_path, monkeypatch) == 0
    assert "error:" not in capsys.readouterr().err
    assert _main_with(failed, tmp_path, monkeypatch, "--systems", "kvscope,hf") == 1
    assert bench.all_failed({"w": {"llamacpp": [{"skipped": "not installed"}]}}) == 0


def test_without_matplotlib_the_run_says_how_to_get_plots(tmp_path: Path, monkeypatch,
                                                          capsys) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises
    assert write_plots(tmp_path, {}, {}) is None
    ok = {"kvscope": "ok", "kvscope-int4": "ok", "hf": "ok", "llamacpp": "skipped"}
    assert _main_with(ok, tmp_path, monkeypatch) == 0
    out = capsys.readouterr().out
    assert NO_PLOTS in out.splitlines()
    assert 'pip install "kvscope[bench]"' in NO_PLOTS and "matplotlib" in NO_PLOTS
    assert not list((tmp_path / "out").glob("*.png"))
    assert (tmp_path / "out" / "bench.json").is_file()


def test_workers_get_absolute_paths_and_run_in_the_callers_directory(tmp_path: Path,
                                                                     monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    args = SimpleNamespace(dtype="float32", threads=1, model="models/m.gguf", hf_batch=8,
                           quick=False, cache_dir="~/cache")
    cmd = bench.worker_command("hf", Path("out/workloads/single.json"), args, 600.0)
    after = {flag: cmd[cmd.index(flag) + 1] for flag in ("--workload", "--model", "--cache-dir")}
    assert after == {"--workload": str(tmp_path / "out/workloads/single.json"),
                     "--model": str(tmp_path / "models/m.gguf"),
                     "--cache-dir": str(Path.home() / "cache")}
    seen = {}

    def fake_run(cmd, **kw):
        seen.update(kw)
        return subprocess.CompletedProcess(cmd, 0, stdout='{"system": "hf"}\n', stderr="")

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    assert bench.run_worker("hf", Path("w.json"), args, 600.0)["system"] == "hf"
    assert seen.get("cwd") in (None, os.getcwd())  # the caller's directory
    assert str(bench.PACKAGE_ROOT) in seen["env"]["PYTHONPATH"].split(os.pathsep)


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


@pytest.mark.slow
def test_the_cli_runs_from_another_directory_on_a_tiny_gguf(tmp_path: Path) -> None:
    """`python -m app.bench` started elsewhere with relative --model, --out and --cache-dir:
    every system (llama.cpp too, when installed) serves the tiny GGUF."""
    from tests.tiny_models import tiny_gguf_file

    shutil.copy(tiny_gguf_file("llama"), tmp_path / "tiny.gguf")
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "app.bench", "--quick", "--workloads", "single,streams-4",
         "--model", "tiny.gguf", "--out", "out", "--cache-dir", "cache", "--threads", "1",
         "--timeout", "300"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert report["config"]["model"] == str(tmp_path / "tiny.gguf")
    assert report["config"]["workloads"] == ["single", "streams-4"]
    assert any((tmp_path / "cache").iterdir())  # the workers' weights cache, where asked
    llama = importlib.util.find_spec("llama_cpp") is not None
    for w, systems in (("single", ("kvscope", "kvscope-int4", "hf")),
                       ("streams-4", ("kvscope", "hf"))):
        for system in (*systems, "llamacpp"):
            [run] = report["runs"][w][system]
            if system == "llamacpp" and not llama:
                assert "skipped" in run
                continue
            assert "error" not in run and "skipped" not in run, (w, system, run)
            workload = json.loads((tmp_path / "out" / "workloads" / f"{w}.json").read_text())
            assert run["output_tokens"] == sum(r["max_tokens"] for r in workload["requests"])
    [row] = report["streams_rows"]
    assert row["streams"] == 4 and row["kvscope"] > 0 and row["hf"] > 0
    assert (row["llamacpp"] is not None) == llama
    assert "streams" in proc.stdout and "vs llama.cpp" in proc.stdout
    plots = importlib.util.find_spec("matplotlib") is not None
    assert (NO_PLOTS in proc.stdout) != plots
