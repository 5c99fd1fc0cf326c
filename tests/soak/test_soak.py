"""CI's soak: two minutes of mixed ZeroMQ and HTTP traffic with a fixed seed (tests/soak)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.soak.procs import REPO

pytestmark = pytest.mark.slow

WINDOW_CHECK = "window event-loop p99 < 50 ms"


@pytest.fixture(scope="module")
def soak(tmp_path_factory) -> dict:
    report = tmp_path_factory.mktemp("soak") / "soak.json"
    r = subprocess.run(
        [sys.executable, "-m", "tests.soak", "--minutes", "2", "--seed", "7", "--report",
         str(report)],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert report.exists(), r.stderr[-3000:]
    return json.loads(report.read_text())


def test_two_minute_soak_holds_every_server_check(soak: dict) -> None:
    failed = [name for name, ok in soak["checks"].items() if not ok and name != WINDOW_CHECK]
    details = {k: soak[k] for k in ("failures", "engine", "http", "telemetry", "counters_after")}
    assert not failed, (failed, details)
    outcomes = soak["requests_by_outcome"]
    # Every kind of traffic really ran.
    for kind in ("zmq_completed", "zmq_aborted", "zmq_vanished", "zmq_malformed",
                 "http_completed", "http_stream_completed", "http_disconnected",
                 "http_malformed", "control_limits"):  # fmt: skip
        assert outcomes.get(kind, 0) > 0, (kind, outcomes)


def test_two_minute_soak_window_stays_responsive(soak: dict) -> None:
    """The attached window's event-loop p99 under the soak (its handler and GC times are in the
    report's window_measurement: what to look at when this fails)."""
    assert soak["checks"][WINDOW_CHECK], (
        soak["window_event_loop_p99_ms"],
        soak.get("window_measurement"),
    )
