"""The engine as an OS process around its life: a model that cannot load (no ready line, exit 1,
the reason on stderr, also through the terminal chat that spawned it), the private `ipc://auto`
directory (0700, removed on exit), and an engine that dies under a client attached with
`--connect`. The torch-free fake engine (tests/ipc/engines.py:fake) keeps most of them quick."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ipc import protocol as P
from ipc.client import ERR_ENGINE_GONE, EngineClient, EngineError
from tests.ipc.helpers import REPO, EngineProc

pytestmark = pytest.mark.slow  # a few seconds each: every test starts processes

FAKE = ["--engine-factory", "tests.ipc.engines:fake"]
FAST_LIVENESS = ["--heartbeat-interval", "0.1", "--client-timeout", "0.5"]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def test_a_model_that_cannot_load_exits_1_before_the_ready_line(tmp_path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file")
    proc = EngineProc(["--model", str(bad)], wait=False)
    assert proc.proc.wait(120) == 1  # docs/PROTOCOL.md section 3: 1 when the model cannot load
    proc._ready_evt.wait(30)  # stdout fully read
    assert proc.ready == {}
    assert proc.progress[0].startswith("KVSCOPE_PROGRESS 0.00")
    assert not any(line.startswith("KVSCOPE_PROGRESS 1.00") for line in proc.progress)
    assert f"error: model='{bad}' is not a GGUF file" in proc.log()


def test_terminal_chat_reports_an_engine_that_never_got_ready(tmp_path) -> None:
    missing = tmp_path / "missing.gguf"
    r = subprocess.run(
        [sys.executable, "-m", "app", "chat", "--model", str(missing), "--decode-weights", "dense"],
        input="hello\n",
        capture_output=True,
        text=True,
        cwd=REPO,
        env=_env(),
        timeout=300,
    )
    assert r.returncode == 1, r.stderr
    assert "the engine did not get ready (exit code 1)" in r.stderr
    assert f"model='{missing}' does not exist" in r.stderr  # the engine's own words, passed on
    assert r.stdout == ""


def test_ipc_auto_is_a_private_directory_removed_on_exit() -> None:
    proc = EngineProc([*FAKE, "--endpoint", "ipc://auto", "--pub-endpoint", "ipc://auto"])
    try:
        endpoint, pub = proc.endpoint, proc.pub_endpoint
        assert endpoint.startswith("ipc://") and pub.startswith("ipc://")
        directory = Path(endpoint[len("ipc://") :]).parent
        assert Path(pub[len("ipc://") :]).parent == directory
        info = directory.stat()
        assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid()
        with EngineClient(endpoint) as c:
            assert c.generate("abcd", max_tokens=3).result(60).text == "xxx"
            with c.subscribe_telemetry() as sub:
                assert isinstance(sub.latest(60), P.Telemetry)
    finally:
        rc = proc.stop(signal.SIGTERM)
    assert rc == 0, proc.log()
    assert not directory.exists()


def test_an_engine_killed_under_an_attached_client_fails_its_stream() -> None:
    """A client that did not spawn the engine (as with --connect) has only the engine's
    messages to go by: after max(3 heartbeats, client_timeout) of silence with a request in
    flight, the request fails with engine_unreachable and the client says so."""
    proc = EngineProc([*FAKE, *FAST_LIVENESS])
    try:
        with EngineClient(proc.endpoint) as c:
            stream = c.generate("abcd", max_tokens=10**6)
            assert isinstance(next(stream), P.Delta)
            proc.proc.kill()
            try:
                while True:
                    assert isinstance(stream.next_event(timeout=60), P.Delta)
            except EngineError as exc:
                assert exc.code == ERR_ENGINE_GONE and "no message from the engine" in exc.message
    finally:
        proc.stop()


def test_terminal_chat_attached_with_connect_survives_the_engine_dying() -> None:
    proc = EngineProc([*FAKE, *FAST_LIVENESS])
    chat = subprocess.Popen(
        [sys.executable, "-m", "app", "chat", "--connect", proc.endpoint, "--max-tokens",
         "1000000", "--temperature", "0"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=REPO, env=_env(),
    )  # fmt: skip
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(iter(lambda: chat.stdout.read(1), "")))
    reader.start()

    def wait_for_output(text: str) -> None:
        hang_guard = time.monotonic() + 120
        while text not in "".join(out):
            assert chat.poll() is None, "the chat must outlive its engine"
            assert time.monotonic() < hang_guard, f"{text!r} never printed: {''.join(out)!r}"
            time.sleep(0.05)

    try:
        chat.stdin.write("hello\n")
        chat.stdin.flush()
        wait_for_output("x")  # the reply streams
        proc.proc.kill()
        wait_for_output("[error:")
        chat.stdin.close()  # end of input: the chat ends normally
        assert chat.wait(60) == 0
        reader.join(60)
        text = "".join(out)
        assert f"[error: [{ERR_ENGINE_GONE}] no message from the engine for" in text
    finally:
        if chat.poll() is None:
            chat.kill()
        proc.stop()
