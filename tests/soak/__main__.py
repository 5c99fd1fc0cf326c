"""`python -m tests.soak --minutes N [--seed S] [--report soak.json]`: the whole system for a
while, then checks that nothing leaked.

Starts the engine (`python -m engine_proc serve`), the HTTP front-end (`python -m app serve
--connect`) and the window (offscreen, attached, measuring its event loop), then runs ZeroMQ and
HTTP actors (tests/soak/actors.py: random prompts with shared system prompts, sampling, n > 1,
streaming and not, aborts, clients that vanish mid-stream, ~5% malformed messages and bodies)
and a control actor (limits, caching switch, flushes) until the time is up. Loopback only;
bounded in time (the deadline) and in requests (each actor runs one at a time).

Checks after the run: every request ended with a terminal response or a clean, expected error;
the pool is back to free or cached blocks; engine RSS after warm-up grew < 5%; open file
descriptors and threads of the engine and the front-end did not grow; a telemetry subscriber saw
no sequence gaps; the window's event-loop p99 < 50 ms. Exit code 0 when all hold.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

from ipc import protocol as P
from ipc.client import TelemetrySubscriber
from tests.soak.actors import ControlActor, HttpActor, Tally, ZmqActor
from tests.soak.procs import (
    SERVER_NICE,
    proc_stats,
    start_engine,
    start_http,
    start_window,
    window_p99_ms,
)

API_KEY = "soak-key-0123456789abcdef"
RSS_GROWTH_LIMIT = 0.05
WINDOW_P99_LIMIT_MS = 50.0
WINDOW_CHECK = "window event-loop p99 < 50 ms"


class TelemetryWatch(threading.Thread):
    """Reads every snapshot as it comes and counts sequence gaps."""

    def __init__(self, pub_endpoint: str) -> None:
        super().__init__(daemon=True, name="soak-telemetry")
        self.sub = TelemetrySubscriber(pub_endpoint)
        self.gaps = 0
        self.snapshots = 0
        self.last: P.Telemetry | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            msg = self.sub.recv(timeout=0.5)
            if isinstance(msg, P.Telemetry):
                if self.last is not None and msg.seq > self.last.seq + 1:
                    self.gaps += msg.seq - self.last.seq - 1
                self.last = msg
                self.snapshots += 1
        self.sub.close()


def model_args(model: str) -> list[str]:
    if model == "tiny":
        from tests.tiny_models import tiny_model_dir

        path = tiny_model_dir("llama", num_layers=2, max_position_embeddings=512)
        return ["--model", str(path), "--num-kv-blocks", "96", "--block-size", "16"]
    if model == "default":
        return ["--num-kv-blocks", "256"]
    return ["--model", model]


def run(args: argparse.Namespace) -> dict:
    seconds = args.minutes * 60
    engine, info = start_engine(model_args(args.model), args.threads)
    http = window = None
    watch = TelemetryWatch(info["pub_endpoint"])
    watch.start()
    try:
        http, url = start_http(info["endpoint"], API_KEY)
        data_dir = tempfile.mkdtemp(prefix="soak-window-")
        window = start_window(info["endpoint"], max(10.0, seconds - 15), data_dir)
        os.nice(SERVER_NICE)  # the actors are load, like the servers (procs.SERVER_NICE)
        tally = Tally()
        actors = (
            [ZmqActor(info["endpoint"], tally, args.seed * 100 + i) for i in range(args.clients)]
            + [HttpActor(url, API_KEY, tally, args.seed * 100 + 50 + i)
               for i in range(args.clients)]
            + [ControlActor(info["endpoint"], tally, args.seed)]
        )  # fmt: skip
        start = time.monotonic()
        deadline = start + seconds
        threads = [threading.Thread(target=a.run, args=(deadline,), daemon=True) for a in actors]
        for t in threads:
            t.start()
        time.sleep(min(30.0, seconds * 0.2))  # warm-up: caches, allocator pools, threads
        warm = {"engine": proc_stats(engine.proc.pid), "http": proc_stats(http.proc.pid)}
        for t in threads:
            t.join(timeout=max(1.0, deadline - time.monotonic()) + 180)
        hung_actors = sum(t.is_alive() for t in threads)
        idle = wait_idle(watch, timeout=60)
        end = {"engine": proc_stats(engine.proc.pid), "http": proc_stats(http.proc.pid)}
        p99, measurement = window_p99_ms(window, timeout=120)
        out = report(
            args, tally, warm, end, watch, idle, p99, hung_actors, time.monotonic() - start
        )
        out["window_measurement"] = measurement
        return out
    finally:
        watch.stop.set()
        for child in (window, http, engine):
            if child is not None:
                child.stop()


def wait_idle(watch: TelemetryWatch, timeout: float) -> dict[str, float]:
    """The newest counters once nothing runs or waits and no block is in use (or the timeout)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        snap = watch.last
        if snap is not None:
            c = snap.counters
            if (
                c["num_requests_running"]
                == c["num_requests_waiting"]
                == c["num_blocks_in_use"]
                == 0
            ):
                return dict(c)
        time.sleep(0.2)
    return dict(watch.last.counters) if watch.last else {}


def report(args, tally, warm, end, watch, idle, p99, hung_actors, elapsed) -> dict:
    def grew(proc: str, key: str) -> int:
        return getattr(end[proc], key) - getattr(warm[proc], key)

    rss_growth = grew("engine", "rss_kb") / max(1, warm["engine"].rss_kb)
    checks = {
        "every request ended cleanly": not tally.failures and hung_actors == 0,
        "no leaked block": bool(idle)
        and idle.get("num_blocks_in_use", 1) == 0
        and idle.get("num_requests_running", 1) == 0
        and idle.get("num_requests_waiting", 1) == 0,
        "engine RSS growth < 5%": rss_growth < RSS_GROWTH_LIMIT,
        "file descriptors did not grow": grew("engine", "fds") <= 0 and grew("http", "fds") <= 0,
        "threads did not grow": grew("engine", "threads") <= 0 and grew("http", "threads") <= 0,
        "no telemetry sequence gaps": watch.gaps == 0 and watch.snapshots > 0,
        WINDOW_CHECK: p99 is not None and p99 < WINDOW_P99_LIMIT_MS,
    }
    return {
        "seed": args.seed,
        "minutes": args.minutes,
        "model": args.model,
        "elapsed_s": round(elapsed, 1),
        "requests_by_outcome": dict(tally.outcomes),
        "requests_total": sum(tally.outcomes.values()),
        "tokens_streamed": tally.tokens,
        "errors_by_code": dict(tally.errors),
        "failures": tally.failures[:50],
        "engine": {
            "rss_kb_warm": warm["engine"].rss_kb,
            "rss_kb_end": end["engine"].rss_kb,
            "rss_growth": round(rss_growth, 4),
            "fds": [warm["engine"].fds, end["engine"].fds],
            "threads": [warm["engine"].threads, end["engine"].threads],
        },  # fmt: skip
        "http": {
            "rss_kb": [warm["http"].rss_kb, end["http"].rss_kb],
            "fds": [warm["http"].fds, end["http"].fds],
            "threads": [warm["http"].threads, end["http"].threads],
        },  # fmt: skip
        "telemetry": {"snapshots": watch.snapshots, "gaps": watch.gaps},
        "counters_after": {
            k: idle.get(k)
            for k in (
                "num_blocks_in_use",
                "num_blocks_cached",
                "num_blocks_empty",
                "prompt_tokens_total",
                "generation_tokens_total",
                "prefix_cache_hits",
                "num_preemptions",
            )
        },  # fmt: skip
        "window_event_loop_p99_ms": p99,
        "checks": checks,
        "passed": all(checks.values()),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.soak", description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--report", default=None, help="write the report as JSON here")
    ap.add_argument(
        "--model", default="tiny", help="tiny (a small random Llama), default, or a path"
    )
    ap.add_argument("--clients", type=int, default=4, help="ZeroMQ actors, and as many HTTP actors")
    ap.add_argument("--threads", type=int, default=1, help="engine torch threads")
    args = ap.parse_args(argv)
    if not 0 < args.minutes <= 24 * 60:
        ap.error("--minutes must be in (0, 1440]")
    result = run(args)  # the window starts before this process lowers its own priority
    text = json.dumps(result, indent=2)
    if args.report:
        Path(args.report).write_text(text)
    print(text)
    for name, ok in result["checks"].items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
