"""The benchmark's KV-memory workloads (issue 14): tiered (host / disk tier vs recompute), restart
(disk-warm vs cold) and int8 KV (capacity at a fixed kv_cache_memory, decode at 4k context):
workload generation, their statistics and table rows by hand, and one end-to-end `app.bench`
run on a tiny random model whose tier counters and concurrency are checked against counts worked
out from the model's shape (never timings)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

import app.bench.suite as bench
from app.bench.kv_table import build_kv_rows
from app.bench.stats import summarize_workload
from app.bench.table import format_table
from app.bench.workloads import (
    FULL,
    LONG,
    QUICK,
    WORKLOAD_SYSTEMS,
    Vocab,
    expand_workloads,
    make_workload,
)

REPO = Path(__file__).resolve().parents[3]
VOCAB = Vocab(49152, list(range(17)))
# Tiny sizes for the tiny random model (tests/tiny_models/: 2 layers, 2 KV heads of 16 dims,
# 512 positions).
TINY_KV = replace(
    QUICK, tiered_prompts=5, tiered_len=32, tiered_pool_prompts=2, tiered_requests=8,
    tiered_user=4, restart_prompts=2, restart_len=40, kvcap_memory=64 * 1024, kvcap_seqs=16,
    kvcap_prompt=28, kvcap_new=4, kv4k_prompt=100, kv4k_new=8, kv4k_memory=256 * 1024,
)


def _by_id(workload: dict) -> dict[str, dict]:
    return {r["id"]: r for r in workload["requests"]}


def _q(rid: str, ttft: float | None = None, tpot: float | None = None) -> dict:
    """One request row of a worker's result (bench_common.request_results' keys)."""
    return {"id": rid, "ttft": ttft, "tpot": tpot, "e2e": ttft, "itl": []}


# ------------------------------------------------------------------------------- workloads


def test_tiered_rotates_16_distinct_prompts_over_a_pool_that_holds_4() -> None:
    """--long's sizes; the default ones are the same shape, smaller (checked below)."""
    w = make_workload("tiered", LONG, 0, VOCAB)
    reqs, meta = w["requests"], w["meta"]
    assert WORKLOAD_SYSTEMS["tiered"] == ("kvscope-recompute", "kvscope-host", "kvscope-disk")
    assert len(reqs) == 24 and meta["prompts"] == 16
    systems = [tuple(r["prompt"][:2000]) for r in reqs]
    assert len(set(systems[:16])) == 16  # 16 distinct system prompts ...
    assert systems[16:] == systems[:8]  # ... in rotation
    assert all(len(r["prompt"]) == 2008 and r["max_tokens"] == 1 for r in reqs)
    assert len({tuple(r["prompt"][2000:]) for r in reqs}) == 24  # a user turn each
    assert reqs[0]["arrival_s"] == 0.0  # one at a time, each after the previous one
    assert all(r["after"] == {"request": p["id"], "tokens": -1}
               for p, r in zip(reqs, reqs[1:], strict=False))
    # 2,008 prompt tokens + 1 output = 126 blocks of 16; a pool of 4 such requests, not 5.
    assert w["engine"] == {"block_size": 16, "num_kv_blocks": 4 * 126}
    assert 4 * 2009 <= 504 * 16 < 5 * 2009
    assert meta["measured"] == [r["id"] for r in reqs[16:]]
    assert meta["shareable_tokens"] == 8 * 2000  # the system prompt: 125 full blocks each
    assert meta["tier_blocks"] >= 16 * 125  # the tiers hold every system prompt


def test_default_tier_workloads_are_the_long_ones_scaled_down() -> None:
    w = make_workload("tiered", FULL, 0, VOCAB)
    assert len(w["requests"]) == 12 and w["meta"]["prompts"] == 6
    assert all(len(r["prompt"]) == 1024 + 8 for r in w["requests"])
    # 1,032 prompt tokens + 1 output = 65 blocks of 16; a pool of 2 such requests
    assert w["engine"] == {"block_size": 16, "num_kv_blocks": 2 * 65}
    r = make_workload("restart", FULL, 0, VOCAB)
    assert [len(q["prompt"]) for q in r["requests"]] == [1024] * 4


def test_restart_serves_the_primed_prompts_again() -> None:
    w = make_workload("restart", LONG, 0, VOCAB)
    by_id, meta = _by_id(w), w["meta"]
    assert WORKLOAD_SYSTEMS["restart"] == ("kvscope-recompute", "kvscope-disk")
    assert meta["prime"] == ["p0", "p1"] and meta["measured"] == ["r0", "r1"]
    for i in range(2):
        assert by_id[f"r{i}"]["prompt"] == by_id[f"p{i}"]["prompt"]
        assert len(by_id[f"p{i}"]["prompt"]) == 2000
    assert by_id["p0"]["prompt"] != by_id["p1"]["prompt"]
    # The restarted engine's first request arrives at its start; the others follow in turn.
    assert by_id["r0"]["arrival_s"] == 0.0 and "after" not in by_id["r0"]
    assert by_id["r1"]["after"] == {"request": "r0", "tokens": -1}
    assert meta["shareable_tokens"] == 2 * 1984  # 124 full blocks before the last token


def test_int8_workloads_fix_the_pool_bytes_for_both_kv_dtypes() -> None:
    assert expand_workloads(["kv-int8"], FULL) == ["kv-capacity", "kv-decode-4k"]
    cap = make_workload("kv-capacity", FULL, 0, VOCAB)
    assert WORKLOAD_SYSTEMS["kv-capacity"] == ("kvscope", "kvscope-kvint8")
    assert cap["engine"]["kv_cache_memory"] == 32 * 2**20
    assert "num_kv_blocks" not in cap["engine"]
    reqs = cap["requests"]
    assert all(r["arrival_s"] == 0.0 and len(r["prompt"]) == 120 for r in reqs)
    # The default model's int8 KV: 2 x 30 layers x 3 heads x (64 + 2) B = 11,880 B/token, so
    # 32 MiB hold 176 blocks = 22 sequences of 128 tokens: more requests than that arrive, and
    # neither the token budget nor the batch cap stops them first.
    assert len(reqs) > (32 * 2**20 // (11880 * 16)) // 8 == 22
    assert cap["engine"]["max_num_batched_tokens"] >= 120 * len(reqs)
    assert cap["engine"]["max_num_seqs"] >= len(reqs)
    dec = make_workload("kv-decode-4k", FULL, 0, VOCAB)
    [r] = dec["requests"]
    assert len(r["prompt"]) + r["max_tokens"] == dec["meta"]["context"] == 4096


@pytest.mark.parametrize("field, value", [("tiered_requests", 6), ("tiered_user", 0),
                                          ("tiered_user", 16), ("tiered_pool_prompts", 6),
                                          ("tiered_pool_prompts", 0)])
def test_bad_tiered_sizes_name_the_field(field: str, value: int) -> None:
    with pytest.raises(ValueError, match=field):
        make_workload("tiered", replace(FULL, **{field: value}), 0, VOCAB)


# ------------------------------------------------------------------------------- statistics


def test_tier_summary_takes_the_measured_requests_only() -> None:
    w = make_workload("tiered", TINY_KV, 0, VOCAB)  # 8 requests: 5 first sights, 3 measured
    ttft = {r["id"]: 1.0 + k for k, r in enumerate(w["requests"])}

    def run(scale: float, hits: int) -> dict:
        return {"requests": [_q(i, scale * t) for i, t in ttft.items()],
                "tiers": {"external_prefix_cache_hits": hits, "kv_host_hits": hits // 16}}

    s = summarize_workload("tiered", [run(1.0, 96), run(3.0, 48), {"error": "x"}], w)
    # measured ttfts 6, 7, 8 (scale 1) and 18, 21, 24 (scale 3): median of the six
    assert s["ttft_seen_p50"] == pytest.approx((8 + 18) / 2)
    assert s["ttft_first_p50"] == pytest.approx(4.5)  # 1 2 3 3 4 | 5 6 9 12 15
    assert s["tier_hit_tokens"] == 72 and s["tier_hit_share"] == pytest.approx(72 / 96)
    assert s["host_hit_blocks"] == 4.5 and "disk_hit_blocks" not in s

    r = make_workload("restart", TINY_KV, 0, VOCAB)
    runs = [{"requests": [_q("r0", 0.1), _q("r1", 0.3)],
             "prime_requests": [_q("p0", 2.0), _q("p1", 4.0)],
             "restart_s": 1.5, "tiers": {}}]
    s = summarize_workload("restart", runs, r)
    assert (s["ttft_seen_p50"], s["ttft_first_p50"]) == (pytest.approx(0.2), 3.0)
    assert s["restart_s"] == 1.5 and s["tier_hit_share"] == 0


def test_int8_summaries_by_hand() -> None:
    cap = make_workload("kv-capacity", TINY_KV, 0, VOCAB)
    runs = [{"requests": [], "peak_concurrent": p,
             "engine_config": {"num_kv_blocks": 28, "block_size": 16}} for p in (13, 14, 14)]
    s = summarize_workload("kv-capacity", runs, cap)
    assert (s["peak_concurrent"], s["pool_tokens"], s["context"]) == (14, 28 * 16, 32)
    dec = make_workload("kv-decode-4k", TINY_KV, 0, VOCAB)  # context 108: 7 blocks
    runs = [{"requests": [_q("d0", 1.0, t)],
             "engine_config": {"num_kv_blocks": 32, "block_size": 16}} for t in (0.1, 0.25, 0.2)]
    s = summarize_workload("kv-decode-4k", runs, dec)
    assert s["decode_tok_s"] == pytest.approx(5.0) and s["seqs_fit"] == 32 // 7


def test_kv_rows_ratios_and_targets() -> None:
    summary = {
        "tiered": {"kvscope-recompute": {"ttft_seen_p50": 10.0, "ttft_first_p50": 10.0,
                                         "measured_requests": 8},
                   "kvscope-host": {"ttft_seen_p50": 0.5, "ttft_first_p50": 10.0,
                                    "tier_hit_share": 1.0},
                   "kvscope-disk": {"ttft_seen_p50": 2.0, "ttft_first_p50": 12.5}},
        "restart": {"kvscope-recompute": {"ttft_seen_p50": 9.0, "restart_s": 2.0},
                    "kvscope-disk": {"error": "exit 1"}},
        "kv-capacity": {"kvscope": {"peak_concurrent": 5, "pool_tokens": 720, "context": 128,
                                    "kv_cache_memory": 32 * 2**20},
                        "kvscope-kvint8": {"peak_concurrent": 9, "pool_tokens": 1400}},
    }
    rows = {(r.section, r.metric): r for r in build_kv_rows(summary)}
    host = rows[("tiered", "TTFT p50 s, prompt seen before (8 requests): host tier vs recompute")]
    assert (host.value, host.baseline, host.ratio, host.passed) == (0.5, 10.0, 20.0, True)
    assert host.target == ">= 10x kvscope-recompute"
    disk = rows[("tiered", "TTFT p50 s, prompt seen before (8 requests): disk tier vs recompute")]
    assert disk.ratio == pytest.approx(5.0) and disk.passed is False
    first = rows[("tiered", "TTFT p50 s, first sight of a prompt: disk tier vs recompute")]
    assert first.ratio == pytest.approx(0.8) and first.passed is None  # no target
    warm = rows[("restart", "TTFT p50 s after a restart, prompt seen before: disk-warm vs cold")]
    assert warm.value is None and warm.ratio is None and warm.passed is None  # a failed system
    cap = rows[("kv-capacity", "sequences at once (128-token context, 32 MiB KV): int8 vs model "
                "dtype")]
    assert (cap.value, cap.baseline, cap.passed) == (9, 5, False)  # 1.8x < 1.9x
    assert cap.ratio == pytest.approx(1.8) and cap.target == ">= 1.9x kvscope"
    assert not any(section == "kv-decode-4k" for section, _ in rows)  # not run: no rows
    summary["kv-capacity"]["kvscope-kvint8"]["peak_concurrent"] = 10
    [cap] = [r for r in build_kv_rows(summary) if r.metric.startswith("sequences at once")]
    assert cap.passed is True
    table = format_table(build_kv_rows(summary))
    assert "20.00x" in table and "PASS" in table and "MISS" in table


# ------------------------------------------------------------------------------- end to end


CEILINGS = {"system": "ceilings", "read_bw_gbs": 10.0, "copy_bw_gbs": 10.0,
            "fp32_matmul_gflops": 40.0, "bf16_matmul_gflops": 1.0,
            "model": {"name": "tiny", "num_params": 1e6, "weight_bytes": 4e6, "dtype": "float32",
                      "vocab_size": 49152, "special_ids": list(range(17)), "eos_token_ids": [2]}}


def _tiers(report: dict, workload: str, system: str) -> dict:
    [run] = report["runs"][workload][system]
    assert "error" not in run, run
    return run


@pytest.mark.slow
def test_the_kv_workloads_end_to_end_on_a_tiny_model(tmp_path: Path, monkeypatch,
                                                     capsys) -> None:
    """`app.bench --workloads tiered,restart,kv-int8` with tiny sizes: every system runs in its
    own worker; tier hits, restart hits and concurrency are what the tiny model's shape says."""
    from tests.tiny_models import tiny_model_dir

    model = tiny_model_dir()  # 2 layers x 2 KV heads x 16 dims
    monkeypatch.setattr(bench, "QUICK", TINY_KV)
    real_worker = bench.run_worker

    def run_worker(system, workload_path, args, timeout):
        if system == "ceilings":  # the machine's ceilings are not what this test is about
            return dict(CEILINGS)
        return real_worker(system, workload_path, args, timeout)

    monkeypatch.setattr(bench, "run_worker", run_worker)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    tmp = tmp_path / "tmp"  # where the workers' disk tiers go
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    rc = bench.main(["--quick", "--workloads", "tiered,restart,kv-int8", "--model", str(model),
                     "--threads", "1", "--out", str(tmp_path / "out"), "--log-level", "WARNING",
                     "--timeout", "300"])
    out = capsys.readouterr().out
    assert rc == 0, out
    report = json.loads((tmp_path / "out" / "bench.json").read_text())

    # tiered: 3 measured requests, each 2 full system-prompt blocks (32 tokens) from the tier.
    for system, tier in (("kvscope-host", "host"), ("kvscope-disk", "disk")):
        t = _tiers(report, "tiered", system)["tiers"]
        assert t[f"kv_{tier}_hits"] == 3 * 2 and t["external_prefix_cache_hits"] == 3 * 32
        assert t[f"kv_{tier}_stores"] >= 5 * 2  # every system prompt went down
    assert "device" in _tiers(report, "tiered", "kvscope-disk")["disk_reads"]
    assert _tiers(report, "tiered", "kvscope-recompute")["tiers"] == {}
    assert _tiers(report, "tiered", "kvscope-recompute")["prefix_cache_hits"] == 0  # all missed
    # restart: the restarted engine loads both prompts' 2 full blocks before the last token.
    warm = _tiers(report, "restart", "kvscope-disk")
    assert warm["flushed_blocks"] >= 2 * 2 and [q["id"] for q in warm["requests"]] == ["r0", "r1"]
    assert warm["tiers"]["kv_disk_hits"] == 2 * 2
    assert warm["tiers"]["external_prefix_cache_hits"] == 2 * 32
    cold = _tiers(report, "restart", "kvscope-recompute")
    assert cold["tiers"] == {} and cold["prefix_cache_hits"] == 0
    # kv-capacity: 64 KiB of KV; model dtype 2*2*2*16*4 = 512 B/token -> 8 blocks -> 4
    # sequences of 32 tokens (2 blocks); int8 2*2*2*(16+2) = 144 B/token -> 28 blocks -> 14.
    for system, blocks in (("kvscope", 8), ("kvscope-kvint8", 28)):
        run = _tiers(report, "kv-capacity", system)
        assert run["engine_config"]["num_kv_blocks"] == blocks
        assert run["peak_concurrent"] == blocks // 2 and run["num_preemptions"] == 0
        assert run["output_tokens"] == 16 * 4  # every request was served
    # kv-decode-4k: 256 KiB hold 32 (model dtype) and 113 (int8) blocks; 108 tokens = 7 blocks.
    summary = report["summary"]["kv-decode-4k"]
    assert summary["kvscope"]["seqs_fit"] == 32 // 7
    assert summary["kvscope-kvint8"]["seqs_fit"] == 113 // 7
    assert summary["kvscope"]["decode_tok_s"] > 0 and summary["kvscope-kvint8"]["decode_tok_s"] > 0

    rows = {(r["section"], r["metric"]): r for r in report["rows"]}
    for section in ("tiered", "restart", "kv-capacity", "kv-decode-4k"):
        assert any(s == section and r["value"] is not None for (s, _), r in rows.items())
    [cap] = [r for (s, _), r in rows.items() if s == "kv-capacity" and r["target"]]
    assert cap["ratio"] == pytest.approx(14 / 4) and cap["passed"] is True
    assert "host tier vs recompute" in out and "disk-warm vs cold" in out
    # The disk tiers' temporary directories are gone.
    assert not [p.name for p in tmp.iterdir() if p.name.startswith("kvscope-bench-kv-")]
