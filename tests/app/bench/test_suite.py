"""app.bench, the driver: its exit status and paths (in-process, with fake workers), plots or the
hint that says how to get them, that it never imports torch, and the whole CLI from another
directory on a tiny GGUF. The rest of the benchmark has its own files: test_bench_workloads.py,
test_bench_stats.py, test_bench_table.py (app's bench modules), test_bench_worker.py
(engine_proc.bench.worker), test_bench_clients.py (the front-end systems, app.bench.clients) and
test_bench_llamacpp.py (llama.cpp's batched runner)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import app.bench.suite as bench
from app.bench.plots import NO_PLOTS, write_plots

REPO = Path(__file__).resolve().parents[3]


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


def test_app_bench_does_not_import_torch() -> None:
    code = ("import sys, app.bench, app.bench.clients, ipc.async_client, httpx; "
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
