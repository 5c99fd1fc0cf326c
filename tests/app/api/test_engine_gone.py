"""`serve` in front of engines whose requests take long enough to act on mid-stream: a client
that disconnects, and an engine that dies and comes back (`serve --connect`)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.app.api.helpers import ServeProc, health, wait_for
from tests.app.api.test_server import _idle, _wait_metrics
from tests.ipc.helpers import TINY, EngineProc

pytestmark = pytest.mark.slow


def test_engine_killed_mid_stream_gives_an_error_event_then_503_then_recovers() -> None:
    engine = EngineProc([*TINY, "--heartbeat-interval", "0.2", "--client-timeout", "5"])
    port = engine.endpoint.rsplit(":", 1)[1]
    serve = ServeProc(["--port", "0", "--connect", engine.endpoint])
    try:
        serve.wait_healthy(60)
        body = {"prompt": "hello", "max_tokens": 400, "stream": True, "ignore_eos": True,
                "temperature": 0}  # fmt: skip
        events: list[str] = []
        with httpx.stream("POST", serve.url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line:
                    continue
                events.append(line)
                if len(events) == 3:
                    engine.proc.kill()
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2][len("data: ") :])["error"]
        assert error["type"] == "unavailable_error" and "engine" in error["message"]
        assert wait_for(lambda: health(serve.url) == 503)
        r = httpx.post(serve.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        # An engine on the same endpoint again: the front-end reattaches by itself.
        engine = EngineProc([*TINY, "--endpoint", f"tcp://127.0.0.1:{port}"])
        assert wait_for(lambda: health(serve.url) == 200, 60), serve.log()
        r = httpx.post(serve.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 200, r.text
    finally:
        serve.stop()
        engine.stop()


def test_disconnect_mid_stream_aborts_the_request_and_frees_its_blocks() -> None:
    serve = ServeProc(
        ["--port", "0", "--engine-args",
         "--engine-factory tests.ipc.engines:paced_tiny --num-threads 1 --telemetry-hz 50"]
    )  # fmt: skip
    try:
        serve.wait_healthy(120)
        before = _wait_metrics(serve, _idle)
        body = {"prompt": "Tell a long story", "max_tokens": 400, "temperature": 0,
                "stream": True, "ignore_eos": True}  # fmt: skip
        with httpx.Client(timeout=60) as http:
            with http.stream("POST", serve.url + "/v1/completions", json=body) as r:
                lines = r.iter_lines()  # kept: a dropped iterator closes the stream at once
                first = next(lines)
                assert first.startswith("data: {") and "error" not in first, first
                busy = _wait_metrics(serve, _holds_blocks, timeout=60)
            # leaving the block closed the connection mid-stream
        assert _holds_blocks(busy), busy
        after = _wait_metrics(serve, lambda m: _idle(m) and m[ABORTED] > before[ABORTED])
        assert after[ABORTED] == before[ABORTED] + 1
        assert after["kvscope:kv_blocks{state=in_use}"] == 0
        generated = (
            after["kvscope:generation_tokens_total"] - before["kvscope:generation_tokens_total"]
        )
        assert generated < 200, "the request ran on after its client left"
    finally:
        serve.stop()


ABORTED = "kvscope:request_success_total{finished_reason=abort}"


def _holds_blocks(m: dict[str, float]) -> bool:
    in_flight = m["kvscope:num_requests_running"] + m["kvscope:num_requests_waiting"]
    return m["kvscope:kv_blocks{state=in_use}"] >= 1 and in_flight == 1
