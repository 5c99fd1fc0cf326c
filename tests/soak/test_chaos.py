"""Chaos, one failure each: the engine killed or frozen under `kvscope serve`, a port already in
use, broken model files. Each must give clients a clear answer and leave the rest serving."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.app.api.helpers import REPO, ServeProc, health, wait_for

pytestmark = pytest.mark.slow

TINY_ENGINE = "--engine-factory tests.ipc.engines:paced_tiny --num-threads 1"


def children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def engine_pid(serve: ServeProc) -> int:
    for pid in children(serve.proc.pid):
        if "engine_proc" in Path(f"/proc/{pid}/cmdline").read_text():
            return pid
    raise AssertionError("no engine child")


def stream_events(url: str, after: int, action) -> list[str]:
    """Start a long stream, run `action` after `after` events, return every data line."""
    body = {"prompt": "hello", "max_tokens": 400, "stream": True, "ignore_eos": True}
    events: list[str] = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line:
                events.append(line)
                if len(events) == after:
                    action()
    return events


def assert_error_then_done(events: list[str]) -> dict:
    assert events[-1] == "data: [DONE]", events[-3:]
    error = json.loads(events[-2][len("data: ") :])["error"]
    assert error["type"] == "unavailable_error", error
    return error


def test_engine_killed_mid_stream_then_the_supervisor_restarts_it() -> None:
    serve = ServeProc(["--port", "0", "--engine-args", TINY_ENGINE])
    try:
        serve.wait_healthy(120)
        first = engine_pid(serve)
        events = stream_events(serve.url, 3, lambda: os.kill(first, signal.SIGKILL))
        assert "engine" in assert_error_then_done(events)["message"]
        r = httpx.post(serve.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        assert wait_for(lambda: health(serve.url) == 200, 120), serve.log()
        assert engine_pid(serve) != first
        r = httpx.post(serve.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 200, r.text
    finally:
        serve.stop()


def test_engine_frozen_past_the_timeout_then_resumed() -> None:
    serve = ServeProc(["--port", "0", "--engine-args", TINY_ENGINE + " --heartbeat-interval 0.3"])
    pid = None
    try:
        serve.wait_healthy(120)
        pid = engine_pid(serve)
        events = stream_events(serve.url, 3, lambda: os.kill(pid, signal.SIGSTOP))
        assert_error_then_done(events)  # silent for 3 heartbeats: the engine counts as gone
        assert health(serve.url) == 503
        os.kill(pid, signal.SIGCONT)
        assert wait_for(lambda: health(serve.url) == 200, 60), serve.log()
        r = httpx.post(serve.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert engine_pid(serve) == pid  # the same engine, reattached
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGCONT)
        serve.stop()


def test_a_port_already_in_use_is_a_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        r = subprocess.run(
            [sys.executable, "-m", "app", "serve", "--port", str(port), "--connect",
             "tcp://127.0.0.1:9"],
            cwd=REPO, capture_output=True, text=True, timeout=60,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
        assert r.returncode == 1 and f"127.0.0.1:{port}" in r.stderr, r.stderr
        r = subprocess.run(
            [sys.executable, "-m", "engine_proc", "serve", "--engine-factory",
             "tests.ipc.engines:tiny", "--endpoint", f"tcp://127.0.0.1:{port}"],
            cwd=REPO, capture_output=True, text=True, timeout=120,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
        assert r.returncode == 1 and "bind" in r.stderr, r.stderr


def _broken_models(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """name -> (model path, the file the error must name)."""
    from tests.tiny_models import tiny_gguf_file, tiny_model_dir

    gguf = tiny_gguf_file("llama")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(gguf.read_bytes()[: gguf.stat().st_size // 2])

    src = tiny_model_dir("llama")
    shapes = tmp_path / "wrong-shapes"
    shutil.copytree(src, shapes)
    config = json.loads((shapes / "config.json").read_text())
    config["hidden_size"] *= 2
    (shapes / "config.json").write_text(json.dumps(config))

    garbage = tmp_path / "garbage-config"
    shutil.copytree(src, garbage)
    (garbage / "config.json").write_text("{this is not json")
    return {
        "truncated gguf": (truncated, "truncated.gguf"),
        "safetensors of other shapes": (shapes, "safetensors"),
        "garbage config.json": (garbage, "config.json"),
    }


def test_broken_model_files_are_clear_errors_naming_the_file(tmp_path: Path) -> None:
    for name, (path, mention) in _broken_models(tmp_path).items():
        r = subprocess.run(
            [sys.executable, "-m", "engine_proc", "serve", "--model", str(path)],
            cwd=REPO, capture_output=True, text=True, timeout=300,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
        assert r.returncode == 1, (name, r.returncode, r.stderr[-2000:])
        last = [line for line in r.stderr.splitlines() if line.startswith("error:")]
        assert last and mention in last[-1], (name, r.stderr[-2000:])
        assert "Traceback" not in r.stderr, (name, r.stderr[-2000:])


def test_serve_with_a_model_that_does_not_load_exits_with_its_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    serve = ServeProc(["--port", "0", "--model", str(bad)])
    try:
        serve.wait_listening(60)
        assert serve.proc.wait(300) == 1
        assert "bad.gguf" in serve.log()
    finally:
        serve.stop()
