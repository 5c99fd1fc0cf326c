"""engine_proc.bench.llamacpp: llama.cpp's batched C API serving a workload, checked token for
token against llama-cpp-python's high-level API (greedy, one sequence at a time) on the tiny
random Llama written as a GGUF (tests/tiny_models/). llama-cpp-python is an optional peer of
the benchmark, not a dependency: the tests that run it skip when it is not importable."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine_proc.bench.common import Req, parse_workload
from engine_proc.bench.llamacpp import CTX_PAD, MAX_SEQS, Plan, run_llamacpp

REPO = Path(__file__).resolve().parents[3]
needs_llama_cpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                     reason="llama-cpp-python is not installed (optional)")


def _req(rid: str, prompt_len: int, max_tokens: int, **when) -> dict:
    prompt = [(7919 * (len(rid) + i) + 31 * prompt_len) % 40000 + 1000 for i in range(prompt_len)]
    return {"id": rid, "prompt": prompt, "max_tokens": max_tokens, **when}


def test_plan_holds_every_concurrent_request() -> None:
    reqs = parse_workload({"requests": [_req("a", 30, 100, arrival_s=0.0),
                                        _req("b", 200, 100, arrival_s=0.0),
                                        _req("c", 10, 5, arrival_s=1.0)]})
    split = Plan.for_requests(reqs, "split")
    assert (split.n_seq, split.seq_len) == (3, 300)
    assert split.n_ctx == 3 * 2 * CTX_PAD  # every stream holds the longest request (300 -> 512)
    unified = Plan.for_requests(reqs, "unified")
    assert unified.n_ctx == 2 * CTX_PAD  # 130 + 300 + 15 cells in one buffer
    many = [Req(f"r{i}", [5] * 8, 4, 0.0, None) for i in range(MAX_SEQS + 10)]
    assert Plan.for_requests(many, "split").n_seq == MAX_SEQS
    with pytest.raises(ValueError, match="kv must be one of"):
        Plan.for_requests(reqs, "paged")


@pytest.fixture(scope="module")
def tiny_gguf() -> Path:
    from tests.tiny_models import tiny_gguf_file

    return tiny_gguf_file("llama")


@pytest.fixture(scope="module")
def reference(tiny_gguf):
    """The high-level API's greedy continuation of a prompt: one sequence, from scratch."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(tiny_gguf), n_ctx=512, n_threads=1, verbose=False)
    cache: dict[tuple[int, ...], list[int]] = {}

    def greedy(prompt: list[int], n: int) -> list[int]:
        key = tuple(prompt)
        if len(cache.get(key, [])) < n:
            llm.reset()
            out = []
            for token in llm.generate(prompt, temp=0.0, reset=True):
                out.append(token)
                if len(out) == n:
                    break
            cache[key] = out
        return cache[key][:n]

    yield greedy
    llm.close()


def _args(model: Path, **kw) -> SimpleNamespace:
    return SimpleNamespace(model=str(model), threads=1, llamacpp_kv=kw.get("kv", "split"),
                           llamacpp_flash_attn=kw.get("flash_attn", "auto"))


MIXED = {"name": "mixed", "requests": [
    _req("a", 12, 9, arrival_s=0.0), _req("bb", 30, 6, arrival_s=0.0),
    _req("ccc", 7, 12, arrival_s=0.0), _req("dddd", 19, 1, arrival_s=0.0),
    _req("late", 25, 5, arrival_s=0.05),  # arrives while the others decode
    _req("next", 16, 4, after={"request": "bb", "tokens": -1}),  # when bb has finished
]}


@needs_llama_cpp
@pytest.mark.slow
@pytest.mark.parametrize("kv", ["split", "unified"])
def test_batched_runner_reproduces_the_high_level_greedy_tokens(tiny_gguf, reference,
                                                                 kv: str) -> None:
    result = run_llamacpp(MIXED, _args(tiny_gguf, kv=kv))
    by_id = {q["id"]: q for q in result["requests"]}
    for r in MIXED["requests"]:
        q = by_id[r["id"]]
        assert q["token_ids"] == reference(r["prompt"], r["max_tokens"]), r["id"]
        assert q["output_tokens"] == len(q["token_times"]) == r["max_tokens"]
        assert q["token_times"] == sorted(q["token_times"]) and q["ttft"] > 0
        assert q["e2e"] >= q["ttft"]
    assert by_id["late"]["arrival"] == pytest.approx(0.05)  # issued at its arrival time
    assert by_id["next"]["arrival"] >= by_id["bb"]["token_times"][-1]  # after bb finished
    assert result["output_tokens"] == sum(r["max_tokens"] for r in MIXED["requests"])
    info = result["llamacpp"]
    assert info["kv"] == kv and info["n_seq_max"] == len(MIXED["requests"])
    # Batched: the four requests at t=0 decode together, so there are far fewer decode calls
    # than decoded tokens.
    assert info["max_running"] >= 3
    assert info["decode_calls"] < sum(r["max_tokens"] - 1 for r in MIXED["requests"])


@needs_llama_cpp
@pytest.mark.slow
@pytest.mark.parametrize("flash_attn", ["auto", "off"])
def test_one_stream_is_the_high_level_loop(tiny_gguf, reference, flash_attn: str) -> None:
    workload = {"requests": [_req("solo", 32, 24, arrival_s=0.0)]}
    result = run_llamacpp(workload, _args(tiny_gguf, flash_attn=flash_attn))
    [q] = result["requests"]
    assert q["token_ids"] == reference(workload["requests"][0]["prompt"], 24)
    info = result["llamacpp"]
    # The prompt in one call, then one token per call: the high-level API's loop.
    assert (info["prefill_calls"], info["decode_calls"], info["max_running"]) == (1, 23, 1)
    assert info["n_seq_max"] == 1


@needs_llama_cpp
@pytest.mark.slow
def test_n_streams_decode_one_token_each_per_call(tiny_gguf, reference) -> None:
    workload = {"requests": [_req("s" * (i + 1), 29, 8, arrival_s=0.0) for i in range(6)]}
    result = run_llamacpp(workload, _args(tiny_gguf))
    info = result["llamacpp"]
    # Every prompt in one prefill call, then 7 calls that each decode all six streams.
    assert (info["prefill_calls"], info["decode_calls"], info["max_running"]) == (1, 7, 6)
    for r, q in zip(workload["requests"], result["requests"], strict=True):
        assert q["token_ids"] == reference(r["prompt"], 8)
        assert len({round(t, 6) for t in q["token_times"]}) == 8
    # Streams of one call share its time stamp: the i-th tokens of all streams are equal.
    times = [q["token_times"] for q in result["requests"]]
    assert all(t == times[0] for t in times)


@needs_llama_cpp
@pytest.mark.slow
def test_sampled_requests_follow_their_seed(tiny_gguf) -> None:
    hot = {"requests": [_req("x", 10, 12, arrival_s=0.0, temperature=1.5, seed=3),
                        _req("y", 10, 12, arrival_s=0.0, temperature=1.5, seed=4)]}
    first, again = (run_llamacpp(hot, _args(tiny_gguf)) for _ in range(2))
    ids = [[q["token_ids"] for q in r["requests"]] for r in (first, again)]
    assert ids[0] == ids[1]  # same seeds, same tokens
    assert ids[0][0] != ids[0][1]  # same prompt, different seeds


@needs_llama_cpp
@pytest.mark.slow
def test_the_worker_cli_still_runs_llamacpp(tiny_gguf, reference, tmp_path: Path) -> None:
    path = tmp_path / "mixed.json"
    path.write_text(json.dumps(MIXED))
    proc = subprocess.run(
        [sys.executable, "-m", "engine_proc.bench.worker", "--system", "llamacpp", "--workload",
         str(path), "--model", str(tiny_gguf), "--threads", "1"],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1  # llama.cpp's log stays off stdout
    result = json.loads(lines[0])
    assert result["system"] == "llamacpp" and result["workload"] == "mixed"
    for r, q in zip(MIXED["requests"], result["requests"], strict=True):
        assert q["token_ids"] == reference(r["prompt"], r["max_tokens"]), r["id"]


def test_the_worker_skips_llamacpp_for_a_model_directory(tmp_path: Path) -> None:
    args = SimpleNamespace(model=str(tmp_path), threads=1)
    result = run_llamacpp({"requests": [_req("a", 4, 2, arrival_s=0.0)]}, args)
    assert set(result) == {"skipped"}
    assert ("needs a .gguf file" in result["skipped"]
            or "llama-cpp-python is not installed" in result["skipped"])
