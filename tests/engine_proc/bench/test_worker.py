"""engine_proc.bench.worker: one real run of the kvscope system on a tiny random model, its
result checked for sanity and its prefix-cache hits against the workload's shared prefix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from app.bench.stats import summarize_workload
from app.bench.workloads import QUICK, Vocab, make_workload

REPO = Path(__file__).resolve().parents[3]
VOCAB = Vocab(49152, list(range(17)))
TINY = replace(
    QUICK, mixed_n=5, mixed_prompt=(3, 40), mixed_out=(2, 6), shared_n=3, shared_prefix=32,
    shared_user=5, shared_out=2, interf_streams=2, interf_long=40, interf_chunk=8,
    interf_warm=2, interf_tail=2, prefill_len=20, single_prompt=8, single_new=4,
)


def _run_worker(system: str, workload: dict, model: Path, tmp_path: Path) -> dict:
    path = tmp_path / f"{workload['name']}.json"
    path.write_text(json.dumps(workload))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", "engine_proc.bench.worker", "--system", system, "--workload",
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
