"""Spawn, watch and stop the engine process (plain Python; the GUI wraps the callbacks in signals).

The engine is `python -m engine_proc serve ...` in its own process (so the GUI never imports
torch). It reports on stdout:
    KVSCOPE_PROGRESS <fraction> <message>      while loading
    KVSCOPE_READY {"endpoint": ..., "pub_endpoint": ..., ...}   once serving
Every other line (stdout and stderr) is kept in a ring buffer and an optional log file, so the GUI
can show the last lines when the engine dies.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ipc.protocol import PROGRESS_PREFIX, READY_PREFIX

log = logging.getLogger(__name__)

# What `engine_proc serve` accepts (app/ must not import engine_proc to ask it).
DTYPES = ("float32", "bfloat16", "float16")
DECODE_WEIGHTS = ("auto", "dense", "int4")
DECODE_ACTIVATIONS = ("auto", "exact", "int8")  # the engine's decode_activations
# The apps' choice (window, serve, chat): llama.cpp's 8-bit arithmetic where our 4-bit kernels run
# (fused_decode.takes_int8_activations): 1.6-1.7x faster replies on AVX2, 1.0-1.1x alone and 1.12x
# beside 16 chats on AVX-512 (Zen 4), and as close to the float32 model as llama.cpp itself
# (python -m engine_proc.bench.decode_quality); the engine's own default stays "exact".
APP_DECODE_ACTIVATIONS = "auto"
DECODE_ACTIVATIONS_HELP = (
    "auto (default): int8 where our 4-bit kernels run (AVX2, AVX-512 with bf16 and VNNI), else "
    "exact; int8: 8-bit activations, llama.cpp's arithmetic, 1.6-1.7x faster replies on AVX2 "
    "CPUs; exact: replies are the 4-bit model's own"
)
KV_CACHE_DTYPES = ("auto", "fp32", "fp16", "int8", "fp8")
KV_DISK_SUBDIR = "kv-cache"  # the disk KV tier's directory, inside the app's data directory


SPECULATIVE_TOKEN_CHOICES = (0, 2, 4, 8)  # draft tokens per step the window offers; 0 = off


@dataclass(slots=True)
class EngineOptions:
    """What the GUI passes to `python -m engine_proc serve` (None = the engine's default)."""

    model: str | None = None
    dtype: str | None = None
    device: str | None = None
    num_kv_blocks: int | None = None
    max_model_len: int | None = None
    decode_weights: str | None = None
    decode_activations: str | None = None  # DECODE_ACTIVATIONS (engine_proc.config)
    num_threads: int | None = None  # torch threads of a CPU engine; None = torch's default
    # KV element type ("auto" | "int8" | "fp8") and the lower KV tiers (bytes; a directory).
    kv_cache_dtype: str | None = None
    kv_host_memory: int | None = None
    kv_disk_dir: str | None = None
    kv_disk_bytes: int | None = None
    # The engine checks client silence only between steps, so one long CPU step could make it
    # drop the GUI (and abort its requests); the GUI is its only client, so be patient.
    client_timeout: float | None = 120.0
    # vLLM-format KV cache events (--kv-events-config JSON, checked by the caller); None = off
    kv_events_config: str | None = None
    # n-gram speculative decoding: draft tokens per step (Engine → Speculative decoding); 0 = off
    speculative_tokens: int = 0
    # proposes the drafts instead of prompt lookup (a .gguf or an HF folder); None = n-gram
    draft_model: str | None = None
    extra_args: list[str] = field(default_factory=list)

    def to_args(self) -> list[str]:
        args: list[str] = []
        for flag, value in (("--model", self.model), ("--dtype", self.dtype),
                            ("--device", self.device), ("--num-kv-blocks", self.num_kv_blocks),
                            ("--max-model-len", self.max_model_len),
                            ("--decode-weights", self.decode_weights),
                            ("--decode-activations", self.decode_activations),
                            ("--num-threads", self.num_threads),
                            ("--kv-cache-dtype", self.kv_cache_dtype),
                            ("--kv-host-memory", self.kv_host_memory),
                            ("--kv-disk-dir", self.kv_disk_dir),
                            ("--kv-disk-bytes", self.kv_disk_bytes),
                            ("--client-timeout", self.client_timeout),
                            ("--kv-events-config", self.kv_events_config)):
            if value is not None:
                args += [flag, str(value)]
        if self.speculative_tokens:
            proposer = ({"model": self.draft_model} if self.draft_model
                        else {"method": "ngram"})  # fmt: skip
            args += ["--speculative-config", json.dumps(
                proposer | {"num_speculative_tokens": self.speculative_tokens})]
        return args + list(self.extra_args)


def gui_engine_threads(cpuinfo: str | None = None, logical: int | None = None) -> int:
    """Torch threads for an engine that shares the machine with the GUI: the physical cores,
    less one when that leaves the GUI no core of its own. Measured on 2 cores with the window
    drawing: 1 engine thread gave 21-23 tok/s, 2 threads 18-19 (a parallel region waits for
    its slowest thread, and the GUI keeps preempting one). Again with the fused step
    (`python -m app.bench.window_threads`, 2 Zen 1 vCPUs, medians of 2): a reply alone 79.8
    tok/s with 1 thread, 80.4 with 2 (1.01x); under 16 load chats 11.6 vs 12.4 (1.07x), the
    load 188 vs 193 tok/s (1.03x); the event loop's p99 22 -> 29 ms alone and 10 -> 15 ms
    under load (1.30x, 1.53x). Two threads buy nothing worth a slower window here."""
    if logical is None:
        try:
            logical = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):  # not Linux
            logical = os.cpu_count() or 1
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    cores: set[tuple[str, str]] = set()
    physical = core = ""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "physical id":
            physical = value
        elif key == "core id":
            core = value
            cores.add((physical, core))
    physical_cores = min(len(cores), logical) if cores else logical
    return max(1, min(physical_cores, logical - 1))


def engine_command(options: EngineOptions, python: str | None = None) -> list[str]:
    return [python or sys.executable, "-m", "engine_proc", "serve", *options.to_args()]


def parse_line(line: str) -> tuple[str, object]:
    """('ready', dict) | ('progress', (fraction, message)) | ('log', line)."""
    s = line.rstrip("\r\n")
    if s.startswith(READY_PREFIX):
        try:
            info = json.loads(s[len(READY_PREFIX):].strip())
        except json.JSONDecodeError:
            return "log", s
        if isinstance(info, dict) and "endpoint" in info:
            return "ready", info
        return "log", s
    if s.startswith(PROGRESS_PREFIX):
        parts = s[len(PROGRESS_PREFIX):].strip().split(" ", 1)
        try:
            frac = float(parts[0])
        except (ValueError, IndexError):
            return "log", s
        return "progress", (min(max(frac, 0.0), 1.0), parts[1] if len(parts) > 1 else "")
    return "log", s


def _child_setup(nice: int) -> Callable[[], None]:
    def setup() -> None:  # runs in the child between fork and exec (Linux only)
        try:
            import ctypes

            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: no orphaned engine if the GUI dies
        except Exception:  # noqa: BLE001 - best effort
            pass
        if nice:
            try:
                os.nice(nice)
            except OSError:
                pass

    return setup


class EngineSupervisor:
    """One engine process. Callbacks run on the supervisor's reader threads."""

    def __init__(
        self,
        command: Sequence[str],
        *,
        on_progress: Callable[[float, str], None] | None = None,
        on_ready: Callable[[dict], None] | None = None,
        on_exit: Callable[[int], None] | None = None,
        on_log: Callable[[str], None] | None = None,
        log_file: str | os.PathLike | None = None,
        env: dict[str, str] | None = None,
        keep_lines: int = 400,
        nice: int = 0,
        name: str = "engine",
    ) -> None:
        self.command = list(command)
        self.name = name  # what the process is called in logs and the exit line
        self.on_progress = on_progress
        self.on_ready = on_ready
        self.on_exit = on_exit
        self.on_log = on_log
        self.log_file = Path(log_file) if log_file else None
        self.env = env
        self.nice = nice
        self.lines: collections.deque[str] = collections.deque(maxlen=keep_lines)
        self.ready_info: dict | None = None
        self.proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self._log_fh = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        assert self.proc is None, "start() once per supervisor"
        env = dict(os.environ if self.env is None else self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        # the engine must find our packages even when the GUI runs from a source checkout
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        if self.log_file:
            self.log_file.parent.mkdir(parents=True, exist_ok=True)
            self._log_fh = open(self.log_file, "a", encoding="utf-8", errors="replace")  # noqa: SIM115
            self._log_fh.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} "
                               f"{' '.join(self.command)}\n")
        log.info("starting %s: %s", self.name, " ".join(self.command))
        self.proc = subprocess.Popen(
            self.command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
            env=env, text=True, encoding="utf-8", errors="replace", bufsize=1,
            preexec_fn=_child_setup(self.nice) if sys.platform.startswith("linux") else None,
        )
        out = threading.Thread(target=self._read, args=(self.proc.stdout, True),
                               name=f"{self.name}-stdout", daemon=True)
        err = threading.Thread(target=self._read, args=(self.proc.stderr, False),
                               name=f"{self.name}-stderr", daemon=True)
        waiter = threading.Thread(target=self._wait, name=f"{self.name}-wait", daemon=True)
        self._threads = [out, err, waiter]
        for t in self._threads:
            t.start()

    def _read(self, stream, is_stdout: bool) -> None:
        for line in stream:
            kind, value = parse_line(line) if is_stdout else ("log", line.rstrip("\r\n"))
            if kind == "ready":
                assert isinstance(value, dict)
                self.ready_info = value
                self._keep(f"[ready] {json.dumps(value)}")
                if self.on_ready:
                    self.on_ready(value)
            elif kind == "progress":
                frac, msg = value  # type: ignore[misc]
                if self.on_progress:
                    self.on_progress(frac, msg)
            else:
                self._keep(str(value))

    def _keep(self, line: str) -> None:
        with self._lock:
            self.lines.append(line)
            if self._log_fh:
                try:
                    self._log_fh.write(line + "\n")
                    self._log_fh.flush()
                except (OSError, ValueError):
                    pass
        if self.on_log:
            self.on_log(line)

    def _wait(self) -> None:
        assert self.proc is not None
        code = self.proc.wait()
        for t in self._threads[:2]:
            t.join(timeout=2.0)  # the last lines explain the exit: read them first
        self._keep(f"[{self.name} exited with code {code}]")
        with self._lock:
            if self._log_fh:
                self._log_fh.close()
                self._log_fh = None
        if self.on_exit:
            self.on_exit(code)

    def tail(self, n: int = 30) -> list[str]:
        with self._lock:
            return list(self.lines)[-n:]

    def stop(self, timeout: float = 5.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout`; returns the exit code."""
        self._stopping = True
        p = self.proc
        if p is None:
            return None
        if p.poll() is None:
            try:
                p.terminate()
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.1f s: killing it", self.name, timeout)
                p.kill()
                p.wait(5.0)
            except ProcessLookupError:
                pass
        return p.returncode

    def terminate(self) -> None:
        """SIGTERM without waiting (GUI thread): `on_exit` reports the exit; `kill()` after a
        grace period if it matters that the process is gone."""
        self._stopping = True
        p = self.proc
        if p is not None and p.poll() is None:
            try:
                p.terminate()
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """Hard kill (tests use it to simulate a crash)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()

    @property
    def stopping(self) -> bool:
        return self._stopping
