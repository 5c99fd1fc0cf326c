"""Start `python -m app serve` as a separate OS process and wait until /health answers 200."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[3]
API_KEY = "test-key-0123456789abcdef"
MODEL = "tiny-llama"
NUM_BLOCKS = 256


class ServeProc:
    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.stderr = tempfile.NamedTemporaryFile("w+", prefix="kvscope-serve-", suffix=".log")
        full_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "app", "serve", *args],
            cwd=REPO,
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
        )
        self.url = ""
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("KVSCOPE_HTTP_READY "):
                self.url = line.split(" ", 1)[1].strip()
                self._ready.set()
        self._ready.set()

    def wait_listening(self, timeout: float = 60.0) -> ServeProc:
        if not self._ready.wait(timeout) or not self.url:
            raise RuntimeError(f"serve did not start listening:\n{self.log()}")
        return self

    def wait_healthy(self, timeout: float = 300.0) -> ServeProc:
        self.wait_listening()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"serve did not get healthy:\n{self.log()}")

    def wait_engines(self, timeout: float = 300.0) -> ServeProc:
        """A disaggregated deployment is healthy with one engine up: wait for both."""
        self.wait_healthy(timeout)
        both = {"prefill": "ready", "decode": "ready"}
        headers = {"authorization": f"Bearer {API_KEY}"}

        def engines() -> dict[str, str]:
            url = self.url + "/kvscope/deployment"
            return httpx.get(url, headers=headers, timeout=30).json()["engines"]

        if not wait_for(lambda: engines() == both, timeout):
            raise RuntimeError(f"both engines did not come up:\n{self.log()}")
        return self

    def log(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read()[-6000:]

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


def wait_for(predicate, timeout: float = 60.0) -> bool:
    """Poll `predicate` every 0.1 s until it holds or `timeout` passes (never a timed assert)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def health(url: str) -> int:
    """GET /health's status code, 0 when the server does not answer."""
    try:
        return httpx.get(url + "/health", timeout=5).status_code
    except httpx.HTTPError:
        return 0
