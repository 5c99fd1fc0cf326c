"""CI's soak: two minutes of mixed ZeroMQ and HTTP traffic with a fixed seed (tests/soak)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.soak.procs import REPO

pytestmark = pytest.mark.slow


def test_two_minute_soak_holds_every_check(tmp_path: Path) -> None:
    report = tmp_path / "soak.json"
    r = subprocess.run(
        [sys.executable, "-m", "tests.soak", "--minutes", "2", "--seed", "7", "--report",
         str(report)],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert report.exists(), r.stderr[-3000:]
    result = json.loads(report.read_text())
    failed = [name for name, ok in result["checks"].items() if not ok]
    assert not failed, (
        failed,
        {
            k: result[k]
            for k in ("failures", "engine", "http", "telemetry", "window_event_loop_p99_ms")
        },
    )
    assert r.returncode == 0
    outcomes = result["requests_by_outcome"]
    # Every kind of traffic really ran.
    for kind in (
        "zmq_completed",
        "zmq_aborted",
        "zmq_vanished",
        "zmq_malformed",
        "http_completed",
        "http_stream_completed",
        "http_disconnected",
        "http_malformed",
        "control_limits",
    ):
        assert outcomes.get(kind, 0) > 0, (kind, outcomes)
