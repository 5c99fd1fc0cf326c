"""app.bench.clients: the engine process behind its ZeroMQ and HTTP front-ends, one real run of
each on a tiny random model, checked against transformers' greedy decoding of the same prompts.

The engine runs `tiny_exact` below: the tiny engine of tests/ipc/engines.py with a tokenizer that
maps every token id to its own character, so the text an HTTP stream delivers spells the token
ids exactly (the HTTP API returns text, not ids).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from app.bench.clients import (
    CLIENT_SYSTEMS,
    Stream,
    engine_options,
    parse_streams,
    request_results,
    summarize,
)
from app.bench.clients import build_parser as clients_parser
from app.bench.stats import summarize_workload
from app.bench.suite import worker_command
from app.bench.table import build_rows
from app.bench.workloads import QUICK, Vocab, make_workload

REPO = Path(__file__).resolve().parents[3]
FIRST_CHAR = 0x4E00  # CJK: one printable character per id of the 128-token tiny vocabulary
TINY = replace(QUICK, streams_n=8, streams_prompt=(20, 40), streams_out=12)


class ExactCharTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(FIRST_CHAR + i) for i in ids)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) - FIRST_CHAR for c in text]}


def tiny_exact(args: argparse.Namespace) -> object:  # the engine factory (engine process)
    from tests.ipc.engines import tiny

    engine = tiny(args)
    engine.tokenizer = ExactCharTokenizer()
    return engine


def hf_greedy(prompt: list[int], n: int) -> list[int]:
    """transformers' forward pass of the same tiny model, argmax n times (EOS not special)."""
    import torch

    from tests.engine_fixtures import tiny_hf_model

    model = tiny_hf_model()
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def _run(system: str, path: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "app.bench.clients", "--system", system, "--workload", str(path),
         "--threads", "1",
         "--engine-args", "--engine-factory tests.app.bench.test_clients:tiny_exact",
         "--timeout", "240"],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_zeromq_and_http_stream_the_engines_greedy_tokens(tmp_path: Path) -> None:
    workload = make_workload("streaming", TINY, 5, Vocab(128, []))
    path = tmp_path / "streaming.json"
    path.write_text(json.dumps(workload))
    results = {system: _run(system, path) for system in CLIENT_SYSTEMS}

    reqs = workload["requests"]
    zmq = {q["id"]: q for q in results["kvscope-zmq"]["requests"]}
    http = {q["id"]: q for q in results["kvscope-http"]["requests"]}
    assert set(zmq) == set(http) == {r["id"] for r in reqs}
    for r in reqs:
        expected = hf_greedy(r["prompt"], r["max_tokens"])
        assert zmq[r["id"]]["token_ids"] == expected, r["id"]
        assert http[r["id"]]["text"] == ExactCharTokenizer().decode(expected), r["id"]
        assert zmq[r["id"]]["text"] == http[r["id"]]["text"]

    for system, result in results.items():
        assert result["system"] == system and result["num_requests"] == len(reqs)
        assert result["output_tokens"] == sum(r["max_tokens"] for r in reqs)
        assert result["prompt_tokens"] == sum(len(r["prompt"]) for r in reqs)
        assert result["wall_s"] > 0 and result["output_tok_s"] > 0
        for q in result["requests"]:
            # Every token of this tokenizer has text: one message per token on both paths.
            assert q["output_tokens"] == q["messages"] == len(q["token_times"]) == TINY.streams_out
            assert q["finish_reason"] == "length" and q["arrival"] == 0.0
            assert q["ttft"] > 0 and q["e2e"] >= q["ttft"] and q["tpot"] >= 0
            assert len(q["itl"]) == TINY.streams_out - 1 and min(q["itl"]) >= 0
        procs = {"engine", "client"} | ({"server"} if system == "kvscope-http" else set())
        assert set(result["cpu_s"]) == procs and set(result["rss_mb"]) == procs
        assert result["peak_rss_mb"] > 50

    summary = {"streaming": {s: summarize_workload("streaming", [r], workload)
                             for s, r in results.items()}}
    for s in summary["streaming"].values():
        assert s["runs"] == 1 and s["streams"] == TINY.streams_n
        assert s["output_tok_s"] > 0 and s["ttft_p50"] > 0 and s["itl_p50"] is not None
        assert s["frontend_cpu_ms_per_token"] >= 0 and 0 <= s["engine_cpu_share"]
    [row] = [r for r in build_rows(summary, None) if r.target]
    assert row.metric == f"HTTP streaming, {TINY.streams_n} streams: output tok/s vs ZeroMQ"
    assert row.ratio == pytest.approx(summary["streaming"]["kvscope-http"]["output_tok_s"]
                                      / summary["streaming"]["kvscope-zmq"]["output_tok_s"])
    assert row.passed is not None


def test_results_count_tokens_by_usage_when_text_is_held_back() -> None:
    # Three tokens reached the client in two messages (the middle token's text was an
    # incomplete UTF-8 sequence): the usage count wins, times stay per message.
    s = Stream("a", [1, 2], 3, 0.0, issued=10.0, times=[10.5, 11.0], counts=[1, 1],
               text=["x", "yz"], usage_tokens=3)
    [q] = request_results([s], t0=10.0)
    assert (q["output_tokens"], q["messages"]) == (3, 2)
    assert q["ttft"] == pytest.approx(0.5) and q["e2e"] == pytest.approx(1.0)
    assert q["tpot"] == pytest.approx(0.25) and q["itl"] == [0.5]
    assert q["text"] == "xyz" and q["token_times"] == [0.5, 1.0]
    summary = summarize([s], t0=10.0)
    assert summary["output_tokens"] == 3 and summary["output_tok_s"] == pytest.approx(3.0)
    # A ZeroMQ delta with two tokens: one time per token.
    z = Stream("b", [1], 2, 0.0, issued=0.0, times=[1.0], counts=[2], token_ids=[5, 6])
    [q] = request_results([z], t0=0.0)
    assert q["token_times"] == [1.0, 1.0] and q["output_tokens"] == 2


def test_parse_streams_refuses_event_triggered_requests() -> None:
    w = {"requests": [{"id": "a", "prompt": [1], "max_tokens": 2, "arrival_s": 0.0},
                      {"id": "b", "prompt": [1], "max_tokens": 2,
                       "after": {"request": "a", "tokens": -1}}]}
    with pytest.raises(ValueError, match=r"requests\[1\]\.arrival_s"):
        parse_streams(w)
    assert [s.id for s in parse_streams({"requests": w["requests"][:1]})] == ["a"]


def test_the_driver_runs_front_end_systems_in_app_bench_clients(tmp_path: Path) -> None:
    args = SimpleNamespace(dtype="float32", threads=1, model=None, hf_batch=8, quick=True,
                           cache_dir=None, engine_decode_weights="auto")
    wl = tmp_path / "streaming.json"
    for system in CLIENT_SYSTEMS:
        cmd = worker_command(system, wl, args, timeout=600.0)
        assert cmd[1:3] == ["-m", "app.bench.clients"] and system in cmd and str(wl) in cmd
        assert cmd[cmd.index("--threads") + 1] == "1"
        assert cmd[cmd.index("--decode-weights") + 1] == "auto"  # the engine it spawns
        parsed = clients_parser().parse_args(cmd[3:])
        assert engine_options({"requests": []}, parsed).decode_weights == "auto"
    assert worker_command("kvscope", wl, args, 600.0)[1:3] == ["-m", "engine_proc.bench.worker"]
