"""Start an engine server as a separate OS process and wait for its ready line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq

from ipc import protocol as P

REPO = Path(__file__).resolve().parents[2]
TINY = ["--engine-factory", "tests.ipc.engines:tiny", "--num-threads", "1"]


class EngineProc:
    """`python -m engine_proc.server ARGS` with stdout parsed for KVSCOPE_READY."""

    def __init__(self, args: list[str], timeout: float = 300.0, wait: bool = True) -> None:
        self.stderr = tempfile.NamedTemporaryFile("w+", prefix="kvscope-engine-", suffix=".log")
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "engine_proc.server", *args],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
        )
        self.progress: list[str] = []
        self.ready: dict[str, Any] = {}
        self._ready_evt = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if wait:
            self.wait_ready(timeout)

    def wait_ready(self, timeout: float = 300.0) -> EngineProc:
        if not self._ready_evt.wait(timeout) or not self.ready:
            self.stop()
            raise RuntimeError(f"engine did not get ready:\n{self.log()}")
        return self

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("KVSCOPE_READY "):
                self.ready = json.loads(line.split(" ", 1)[1])
                self._ready_evt.set()
            elif line.startswith("KVSCOPE_PROGRESS "):
                self.progress.append(line.strip())
        self._ready_evt.set()

    @property
    def endpoint(self) -> str:
        return self.ready["endpoint"]

    @property
    def pub_endpoint(self) -> str:
        return self.ready["pub_endpoint"]

    def log(self) -> str:
        self.stderr.flush()
        return Path(self.stderr.name).read_text()[-5000:]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def raw_dealer(
    endpoint: str, ctx: zmq.Context | None = None, routing_id: bytes | None = None
) -> zmq.Socket:
    s = (ctx or zmq.Context.instance()).socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if routing_id is not None:
        s.setsockopt(zmq.ROUTING_ID, routing_id)
    s.connect(endpoint)
    return s


def recv_msg(sock: zmq.Socket, timeout: float = 10.0) -> Any:
    if not sock.poll(int(timeout * 1000)):
        raise TimeoutError("no reply")
    return P.decode_engine(sock.recv())


def wait_telemetry(sub: Any, predicate: Any, timeout: float = 10.0) -> P.Telemetry:
    """First snapshot (received within `timeout`) for which predicate(snapshot) is true."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = sub.recv(max(0.0, deadline - time.monotonic()))
        if isinstance(msg, P.Telemetry) and predicate(msg):
            return msg
    raise TimeoutError("no matching telemetry snapshot")


DOC_CLIENT_KINDS = ("hello", "generate", "tokenize", "detokenize", "abort", "control",
                    "heartbeat", "goodbye")  # fmt: skip


def documented_error_code(frame: bytes) -> str:
    """The `error` code docs/PROTOCOL.md (section 4.2's table) gives a client frame that is not a
    valid message, judged with a generic MessagePack decoder rather than ipc.protocol:
    bad_message when it is not one MessagePack value, unknown_kind when it is a map whose `kind`
    is missing, not a string or not a client kind, invalid_message for anything else (a
    non-map, a wrong type, a missing or unknown field, a broken cross-field rule)."""
    try:
        obj = msgspec.msgpack.decode(frame)
    except msgspec.DecodeError:
        return "bad_message"
    if isinstance(obj, dict):
        kind = obj.get("kind")
        if not isinstance(kind, str) or kind not in DOC_CLIENT_KINDS:
            return "unknown_kind"
    return "invalid_message"


def is_msgpack_map(frame: bytes) -> bool:
    try:
        obj = msgspec.msgpack.decode(frame)
    except msgspec.DecodeError:
        return False
    return isinstance(obj, dict) and "kind" in obj
