"""app/remote against a real `kvscope serve`: the telemetry stream over HTTP carries the very
snapshots the engine publishes on ZeroMQ, and streamed chat matches the SDK's reply."""

from __future__ import annotations

import http.server
import threading

import httpx
import pytest

from app.remote.kvscope_http import RemoteError, fetch_welcome, stream_telemetry
from app.remote.openai_client import ReplyStats, list_models, stream_chat
from ipc.client import TelemetrySubscriber
from tests.app.api.helpers import API_KEY, MODEL

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "Say something about caches."}]


def test_http_telemetry_equals_the_engines_zeromq_telemetry(server) -> None:
    welcome = fetch_welcome(server.url, API_KEY)
    assert welcome.model.num_blocks == 256 and welcome.model.block_size == 16
    with TelemetrySubscriber(welcome.pub_endpoint) as sub:
        zmq_snaps = {}
        over_http = stream_telemetry(server.url, API_KEY)
        try:
            for snap in over_http:
                while (z := sub.recv(timeout=5.0)) is not None:
                    if hasattr(z, "seq"):
                        zmq_snaps[z.seq] = z
                    if hasattr(z, "seq") and z.seq >= snap.seq:
                        break
                if snap.seq in zmq_snaps:
                    assert snap == zmq_snaps[snap.seq]
                    break
            else:
                pytest.fail("the HTTP stream ended")
        finally:
            over_http.close()


def test_wrong_key_and_unreachable_and_not_openai() -> None:
    with pytest.raises(RemoteError, match="cannot reach"):
        list_models("http://127.0.0.1:9", None, timeout=2)

    class NotOpenAI(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            body = b"<html>hello</html>"
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotOpenAI)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        with pytest.raises(RemoteError, match="not an OpenAI-compatible server"):
            list_models(url, None)
        with pytest.raises(RemoteError):
            fetch_welcome(url, None)
    finally:
        httpd.shutdown()


def test_streamed_chat_matches_the_sdk_and_reports_timing(server, sdk) -> None:
    with pytest.raises(RemoteError, match="401"):
        list_models(server.url, "wrong-key")
    assert [m["id"] for m in list_models(server.url, API_KEY)] == [MODEL]
    want = sdk.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0)
    stats = ReplyStats(start=0.0)
    import time

    stats.start = time.monotonic()
    with httpx.Client(timeout=60) as http_client:
        events = list(
            stream_chat(http_client, server.url, API_KEY,
                        {"model": MODEL, "messages": CHAT, "max_tokens": 10, "temperature": 0},
                        stats)
        )  # fmt: skip
    text = "".join(e.text for e in events if hasattr(e, "text"))
    assert text == want.choices[0].message.content
    assert stats.usage is not None and stats.usage.completion_tokens == want.usage.completion_tokens
    assert stats.usage.cached_tokens is not None
    assert stats.ttft is not None and stats.finish_reason == want.choices[0].finish_reason
