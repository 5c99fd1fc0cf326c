"""The spec-ngram / spec-draft workloads (app/bench/spec_workloads.py, spec_stats.py,
spec_table.py): how the names expand, the requests they serve, their statistics and table by
hand, the driver with fake workers, and (slow) a real run of spec-ngram-1 on a tiny GGUF."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

import app.bench.suite as bench
from app.bench.spec_stats import covered, decode_tok_s, exactness, summarize_spec
from app.bench.spec_table import build_spec_rows, format_spec_table
from app.bench.spec_workloads import (
    NEEDS_DRAFT,
    NGRAM_CONFIG,
    NO_BATCHED_LOOKUP,
    NO_DRAFT_PEER,
    SPEC_WORKLOADS,
    spec_level,
)
from app.bench.workloads import (
    FULL,
    QUICK,
    WORKLOAD_SYSTEMS,
    Vocab,
    expand_workloads,
    make_workload,
)
from tests.app.bench.test_suite import CEILINGS, REPO, _fake_result

PROMPTS = {"quote": [101, 102, 103, 104], "edit-code": [201, 202, 203], "free": [301, 302]}
VOCAB = Vocab(49152, list(range(17)), PROMPTS)


def test_spec_names_expand_like_streams() -> None:
    assert SPEC_WORKLOADS == ("spec-ngram-1", "spec-ngram-16", "spec-draft-1", "spec-draft-16")
    assert expand_workloads(["spec-ngram"], FULL) == ["spec-ngram-1", "spec-ngram-16"]
    assert expand_workloads(["spec-draft", "spec-ngram-1"], QUICK) == [
        "spec-draft-1", "spec-draft-16", "spec-ngram-1"]
    three = replace(FULL, spec_levels=(1, 4, 16))
    with pytest.raises(ValueError, match="spec-ngram-4"):  # a level with no workload name
        expand_workloads(["spec-ngram"], three)
    assert spec_level("spec-ngram-16") == ("spec-ngram", 16)
    assert spec_level("spec-draft-1") == ("spec-draft", 1)
    assert spec_level("streams-16") is None and spec_level("spec-ngram") is None
    assert WORKLOAD_SYSTEMS["spec-ngram-1"] == ("kvscope", "kvscope-spec", "llamacpp",
                                                "llamacpp-lookup")
    assert WORKLOAD_SYSTEMS["spec-draft-16"] == ("kvscope", "kvscope-spec", "llamacpp")


def test_one_stream_serves_each_kind_in_turn_greedy_with_the_real_ids() -> None:
    w = make_workload("spec-ngram-1", FULL, 0, VOCAB)
    other_seed = make_workload("spec-ngram-1", FULL, 5, VOCAB)
    assert w["requests"] == other_seed["requests"]  # real text: no draws from the seed
    first, second = w["requests"]
    assert (first["id"], first["kind"], first["prompt"]) == ("quote-0", "quote", PROMPTS["quote"])
    assert first["arrival_s"] == 0.0 and "after" not in first
    assert second["kind"] == "edit-code" and second["prompt"] == PROMPTS["edit-code"]
    assert second["after"] == {"request": "quote-0", "tokens": -1}  # alone, after the first
    # greedy, up to 128 tokens, ending at the end of turn like a chat
    assert all(r["max_tokens"] == FULL.spec_new == 128 and "temperature" not in r
               and r["ignore_eos"] is False for r in w["requests"])
    assert w["meta"]["speculative_config"] == NGRAM_CONFIG
    assert w["meta"]["lookup"] == {"max_ngram_size": 4, "num_pred_tokens": 4}
    assert w["engine"] == {"decode_weights": "auto", "decode_step": "fused",
                           "decode_activations": "auto"}  # fmt: skip


def test_sixteen_streams_at_once_and_the_draft_model_path() -> None:
    w = make_workload("spec-ngram-16", QUICK, 0, VOCAB)
    reqs = w["requests"]
    assert len(reqs) == 16 and all(r["arrival_s"] == 0.0 for r in reqs)
    assert [r["kind"] for r in reqs[:3]] == ["quote", "edit-code", "quote"]
    assert len({r["id"] for r in reqs}) == 16 and reqs[0]["max_tokens"] == QUICK.spec_new
    d = make_workload("spec-draft-16", QUICK, 0, VOCAB, "/models/draft.gguf")
    assert d["meta"]["speculative_config"] == {"model": "/models/draft.gguf",
                                               "num_speculative_tokens": 4}
    assert [r["kind"] for r in d["requests"][:4]] == ["quote", "edit-code", "free", "quote"]
    assert len(make_workload("spec-draft-1", QUICK, 0, VOCAB)["requests"]) == 3
    with pytest.raises(ValueError, match="chat_prompts"):
        make_workload("spec-ngram-1", QUICK, 0, Vocab(49152, []))


def test_decode_throughput_counts_only_decoding_time() -> None:
    assert covered([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0), (3.2, 3.5)]) == pytest.approx(3.0)
    # One after another: 4 + 2 decoded tokens over 1.0 + 0.5 s (the 1 s gap, the second
    # prompt's wait and prefill, is out).
    seq = [{"id": "quote-0", "token_times": [0.0, 0.25, 0.5, 0.75, 1.0]},
           {"id": "edit-code-0", "token_times": [2.0, 2.25, 2.5]}]
    assert decode_tok_s(seq) == pytest.approx(6 / 1.5)
    s = summarize_spec("spec-ngram-1", [{"requests": seq, "spec_decode": {
        "num_draft_tokens": 8, "num_accepted_tokens": 6}}], {"meta": {"kinds": ["quote",
                                                                               "edit-code"]}})
    assert s["decode_tok_s"] == pytest.approx(4.0) and s["streams"] == 1
    assert s["decode_tok_s_by_kind"] == {"quote": pytest.approx(4.0),
                                         "edit-code": pytest.approx(4.0)}
    assert s["acceptance"] == pytest.approx(0.75)
    assert "acceptance" not in summarize_spec("spec-ngram-1", [{"requests": seq}], {})
    assert summarize_spec("streams-1", [{"requests": seq}], {}) == {}


def test_exactness_compares_each_repeat_and_kind() -> None:
    def run(quote: list[int], code: list[int]) -> dict:
        return {"requests": [{"id": "quote-0", "token_ids": quote},
                             {"id": "edit-code-0", "token_ids": code}]}

    runs = {"kvscope": [run([1, 2], [3, 4]), run([1, 2], [3, 4])],
            "kvscope-spec": [run([1, 2], [3, 4]), run([1, 2], [3, 5])],
            "llamacpp": [run([1, 2], [3, 4])], "llamacpp-lookup": [{"skipped": "n/a"}]}
    out = exactness(runs)
    assert out["kvscope-spec"] == {"all": False, "quote": True, "edit-code": False}
    assert out["llamacpp-lookup"] == {"all": None}  # nothing to compare


def _level(base: float, spec: float, llama: float | None, lookup: float | None) -> dict:
    by = {"kvscope": {"decode_tok_s": base, "decode_tok_s_by_kind": {"quote": base / 2}},
          "kvscope-spec": {"decode_tok_s": spec, "acceptance": 0.6,
                           "decode_tok_s_by_kind": {"quote": spec / 4}},
          "llamacpp": {"decode_tok_s": llama} if llama else {"error": "exit 1"},
          "llamacpp-lookup": {"decode_tok_s": lookup} if lookup else {"error": "n/a: ..."}}
    return by


def test_the_table_ratios_and_targets_by_hand() -> None:
    summary = {"spec-ngram-16": _level(300.0, 290.0, 400.0, None),
               "spec-ngram-1": _level(40.0, 100.0, 60.0, 80.0),
               "streams-1": {"kvscope": {"decode_tok_s": 40.0}}}
    exact = {"spec-ngram-1": {"kvscope-spec": {"all": True, "quote": True,
                                               "edit-code": True}}}
    rows = build_spec_rows(summary, exact)
    assert [(r.streams, r.kind) for r in rows] == [(1, "all"), (1, "quote"), (1, "edit-code"),
                                                   (16, "all"), (16, "quote"), (16, "edit-code")]
    one, quote, code, sixteen = rows[0], rows[1], rows[2], rows[3]
    assert one.vs_kvscope == pytest.approx(2.5)  # 100 / 40
    assert one.vs_lookup == pytest.approx(1.25)  # 100 / 80
    assert one.lookup_gain == pytest.approx(80 / 60)
    assert (one.acceptance, one.exact, one.target, one.passed) == (0.6, True, ">= 2x kvscope",
                                                                    True)
    # per kind: kvscope-spec 100 / 4 = 25 over kvscope 40 / 2 = 20; no target on kind rows
    assert quote.vs_kvscope == pytest.approx(1.25) and quote.target == "" and quote.passed is None
    assert code.tok_s["kvscope"] is None and code.vs_kvscope is None
    assert sixteen.vs_kvscope == pytest.approx(290 / 300) and sixteen.passed is False
    assert sixteen.target == ">= 1x kvscope" and sixteen.peer_na == NO_BATCHED_LOOKUP
    assert sixteen.vs_lookup is None and sixteen.exact is None
    table = format_spec_table(rows).splitlines()
    assert "spec/kvscope" in table[0] and "spec/lookup" in table[0]
    assert table[2].split()[:11] == ["spec-ngram", "1", "all", "40.00", "100", "60.00", "80.00",
                                     "2.50x", "1.25x", "1.33x", "60%"]
    assert table[2].split()[11:] == ["same", ">=", "2x", "kvscope", "PASS"]
    assert table[5].split()[6:10] == ["n/a", "0.97x", "n/a", "n/a"] and table[5].endswith("MISS")
    assert table[-1] == f"  spec-ngram-16: {NO_BATCHED_LOOKUP}"
    draft = build_spec_rows({"spec-draft-1": _level(40.0, 60.0, 60.0, None)}, {})
    assert [r.kind for r in draft] == ["all", "quote", "edit-code", "free"]
    assert draft[0].peer_na == NO_DRAFT_PEER and draft[0].target == ""
    assert draft[0].vs_kvscope == pytest.approx(1.5)


def test_the_driver_runs_spec_ngram_and_skips_spec_draft_without_a_model(
        tmp_path: Path, monkeypatch, capsys) -> None:
    seen: dict[str, dict] = {}

    def fake_run_worker(system, workload_path, args, timeout):
        if system == "ceilings":
            return json.loads(json.dumps(CEILINGS)) | {
                "model": CEILINGS["model"] | {"chat_prompts": PROMPTS}}
        seen[f"{Path(workload_path).stem}/{system}"] = json.loads(Path(workload_path).read_text())
        result = _fake_result(system, workload_path)
        for q, r in zip(result["requests"], seen[f"{Path(workload_path).stem}/{system}"]
                        ["requests"], strict=True):
            q["token_ids"] = list(range(r["max_tokens"]))
        if system == "kvscope-spec":
            result["spec_decode"] = {"num_draft_tokens": 10, "num_accepted_tokens": 7}
        return result

    monkeypatch.setattr(bench, "run_worker", fake_run_worker)
    monkeypatch.setattr(bench, "llamacpp_installed", lambda: True)
    rc = bench.main(["--quick", "--workloads", "spec-ngram-1,spec-draft-1", "--threads", "1",
                     "--out", str(tmp_path / "out"), "--log-level", "WARNING"])
    assert rc == 0
    out = capsys.readouterr().out
    assert set(seen) == {f"spec-ngram-1/{s}" for s in WORKLOAD_SYSTEMS["spec-ngram-1"]}
    assert seen["spec-ngram-1/kvscope"]["requests"][0]["prompt"] == PROMPTS["quote"]
    assert f"spec-draft-1/kvscope-spec: {NEEDS_DRAFT}" in out
    report = json.loads((tmp_path / "out" / "bench.json").read_text())
    row = next(r for r in report["spec_rows"] if r["workload"] == "spec-ngram"
               and r["kind"] == "all")
    assert row["exact"] is True and row["acceptance"] == pytest.approx(0.7)
    assert row["vs_kvscope"] == pytest.approx(1.0)  # the fake workers are all alike
    assert "spec/kvscope" in out and "spec-ngram" in out
    # With a draft model the path reaches the workload, absolute.
    seen.clear()
    assert bench.main(["--quick", "--workloads", "spec-draft-1", "--threads", "1",
                       "--out", str(tmp_path / "out2"), "--draft-model", "d.gguf",
                       "--log-level", "WARNING"]) == 0
    spec = seen["spec-draft-1/kvscope-spec"]["meta"]["speculative_config"]
    assert spec["model"] == str(Path("d.gguf").resolve())


def test_a_worker_that_refuses_its_config_says_why(monkeypatch) -> None:
    def fake_run(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 2, stderr="", stdout=json.dumps(
            {"system": "kvscope-spec", "error": "speculative_config: draft models ..."}) + "\n")

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    args = bench.build_parser().parse_args([])
    args.threads, args.hf_batch = 1, 8
    result = bench.run_worker("kvscope-spec", Path("w.json"), args, 60.0)
    assert result == {"system": "kvscope-spec", "error": "speculative_config: draft models ..."}


@pytest.mark.slow
def test_spec_ngram_1_runs_end_to_end_on_a_tiny_gguf(tmp_path: Path) -> None:
    """`python -m app.bench --workloads spec-ngram-1` on a tiny random GGUF: kvscope and
    kvscope-spec (and both llama.cpp systems, when installed) serve the real prompts; the
    speculating tokens equal kvscope's."""
    from tests.tiny_models import tiny_gguf_file

    shutil.copy(tiny_gguf_file("llama"), tmp_path / "tiny.gguf")
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "app.bench", "--quick", "--workloads", "spec-ngram-1",
         "--model", "tiny.gguf", "--out", "out", "--threads", "1", "--timeout", "300"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "bench.json").read_text())
    runs = report["runs"]["spec-ngram-1"]
    llama = importlib.util.find_spec("llama_cpp") is not None
    for system in WORKLOAD_SYSTEMS["spec-ngram-1"]:
        [run] = runs[system]
        if system.startswith("llamacpp") and not llama:
            assert "skipped" in run
            continue
        assert "error" not in run and "skipped" not in run, (system, run)
        assert all(1 <= q["output_tokens"] <= QUICK.spec_new for q in run["requests"])
    assert runs["kvscope-spec"][0]["spec_decode"]["active"] is True
    assert report["spec_exact"]["spec-ngram-1"]["kvscope-spec"]["all"] is True
    if llama:  # llama.cpp's prompt lookup is exact too (same flash attention as the plain run)
        assert report["spec_exact"]["spec-ngram-1"]["llamacpp-lookup"]["all"] is True
    row = report["spec_rows"][0]
    assert row["kind"] == "all" and row["tok_s"]["kvscope"] > 0 and row["vs_kvscope"] > 0
    assert "spec/kvscope" in proc.stdout
