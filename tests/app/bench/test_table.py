"""app.bench.table: the report's rows (ratios against baselines and ceilings, verdicts against
the targets), the streaming HTTP-vs-ZeroMQ rows and the streams-N table, by hand."""

from __future__ import annotations

import pytest

from app.bench.table import build_rows, build_streams_rows, format_streams_table, format_table


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
    assert one.target == ">= 1.2x llama.cpp" and one.passed is False
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
    assert one.exact is None and "exact" not in lines[0]  # kvscope-exact did not run

    # kvscope-exact (float32 activations): its own columns and verdict against the same target
    summary["streams-1"]["kvscope-exact"] = {"decode_tok_s": 31.0}
    one = build_streams_rows(summary)[0]
    assert one.exact_vs_llamacpp == pytest.approx(1.24) and one.exact_passed is True
    assert one.passed is False  # the app's arithmetic's verdict is its own
    lines = format_streams_table(build_streams_rows(summary)).splitlines()
    assert "exact tok/s" in lines[0] and "exact vs llama.cpp" in lines[0]
    assert lines[2].split()[-3:] == ["31.00", "1.24x", "PASS"]
    assert lines[3].split()[-2:] == ["-", "-"]  # 4 streams: kvscope-exact not measured
