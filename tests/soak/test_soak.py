"""CI's soak: half a minute of mixed ZeroMQ and HTTP traffic with a fixed seed (tests/soak).

The test asserts what the machine's speed cannot change: every server check, no failure, no
leak, every kind of traffic ran, and the attached window answered its latency probe. How fast
the window answered is a measurement, not a test: `python -m tests.soak --minutes 2` prints its
event-loop p99 and exits non-zero when it misses 50 ms."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.soak.__main__ import WINDOW_CHECK
from tests.soak.procs import REPO

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def soak(tmp_path_factory) -> dict:
    report = tmp_path_factory.mktemp("soak") / "soak.json"
    r = subprocess.run(
        [sys.executable, "-m", "tests.soak", "--minutes", "0.5", "--seed", "7", "--report",
         str(report)],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert report.exists(), r.stderr[-3000:]
    return json.loads(report.read_text())


def test_soak_holds_every_server_check(soak: dict) -> None:
    failed = [name for name, ok in soak["checks"].items() if not ok and name != WINDOW_CHECK]
    details = {k: soak[k] for k in ("failures", "engine", "http", "telemetry", "counters_after")}
    assert not failed, (failed, details)
    outcomes = soak["requests_by_outcome"]
    # Every kind of traffic really ran.
    for kind in ("zmq_completed", "zmq_aborted", "zmq_vanished", "zmq_malformed",
                 "http_completed", "http_stream_completed", "http_disconnected",
                 "http_malformed", "http_constrained_completed", "control_limits"):  # fmt: skip
        assert outcomes.get(kind, 0) > 0, (kind, outcomes)
    # the Responses and Messages APIs, streamed or not
    agent_kinds = ("http_agent_completed", "http_agent_stream_completed")
    agents = sum(outcomes.get(k, 0) for k in agent_kinds)
    assert agents > 0, outcomes


def test_the_attached_window_answered_throughout(soak: dict) -> None:
    """The window ran its latency probe under the soak and reported it (the figure itself is in
    the report, window_event_loop_p99_ms, with its handler and GC times)."""
    assert soak["window_event_loop_p99_ms"] is not None, soak.get("window_measurement")
    assert any("under load:" in line for line in soak["window_measurement"])
