"""The processes a soak run starts (engine, HTTP front-end, offscreen window) and what it reads
of them from /proc: resident memory, open file descriptors, threads."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# The window spawns its own engine at nice 5 (ui/window/main_window.py): the servers and the load
# run at that priority here too, and the window, the thing whose responsiveness is measured, at 0.
SERVER_NICE = 5


@dataclass(slots=True)
class ProcStats:
    rss_kb: int
    fds: int
    threads: int


def proc_stats(pid: int) -> ProcStats:
    rss = threads = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
            elif line.startswith("Threads:"):
                threads = int(line.split()[1])
    return ProcStats(rss, len(os.listdir(f"/proc/{pid}/fd")), threads)


class Child:
    """A child process whose stdout lines are watched for a ready line; stderr to a log file."""

    def __init__(
        self, name: str, argv: list[str], ready_prefix: str, env: dict | None = None, nice: int = 0
    ) -> None:
        self.name = name
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"soak-{name}-", suffix=".log")
        full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, *argv], cwd=REPO, env=full_env, stdout=subprocess.PIPE,
            stderr=self.log, text=True, preexec_fn=(lambda: os.nice(nice)) if nice else None,
        )  # fmt: skip
        self.ready_line = ""
        self.lines: list[str] = []
        self._ready = threading.Event()
        self._prefix = ready_prefix
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.startswith(self._prefix) and not self._ready.is_set():
                self.ready_line = line[len(self._prefix) :].strip()
                self._ready.set()
        self._ready.set()

    def wait_ready(self, timeout: float) -> str:
        if not self._ready.wait(timeout) or not self.ready_line:
            raise RuntimeError(f"{self.name} did not start:\n{self.tail()}")
        return self.ready_line

    def tail(self, n: int = 4000) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-n:]

    def stop(self, timeout: float = 20.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


def start_engine(model_args: list[str], threads: int) -> tuple[Child, dict]:
    engine = Child(
        "engine",
        ["-m", "engine_proc", "serve", *model_args, "--num-threads", str(threads),
         "--client-timeout", "30"],
        "KVSCOPE_READY", nice=SERVER_NICE,
    )  # fmt: skip
    info = json.loads(engine.wait_ready(600))
    return engine, info


def start_http(endpoint: str, api_key: str) -> tuple[Child, str]:
    http = Child(
        "http", ["-m", "app", "serve", "--connect", endpoint, "--port", "0", "--api-key", api_key],
        "KVSCOPE_HTTP_READY", nice=SERVER_NICE,
    )  # fmt: skip
    return http, http.wait_ready(60)


def start_window(endpoint: str, seconds: float, data_dir: str) -> Child:
    """The real window, offscreen, attached to the engine; it prints its event-loop latency
    percentiles after `seconds`."""
    return Child(
        "window",
        [
            "-m",
            "app",
            "--connect",
            endpoint,
            "--measure-latency",
            f"{seconds:.0f}",
            "--data-dir",
            data_dir,
            "--timeout",
            "120",
        ],
        "GUI event-loop latency",
        env={"QT_QPA_PLATFORM": "offscreen"},
    )


def window_p99_ms(window: Child, timeout: float) -> tuple[float | None, list[str]]:
    """The window's event-loop p99 under load, and its whole measurement (handler times, CPU)."""
    deadline = time.monotonic() + timeout
    while window.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    lines = list(window.lines)
    start = next((i for i, line in enumerate(lines) if "GUI event-loop latency" in line), None)
    measurement = [] if start is None else [line.strip() for line in lines[start:]]
    for line in measurement:
        if "under load:" in line and "p99" in line:
            return float(line.split("p99", 1)[1].split("ms")[0]), measurement
    return None, measurement
