"""A small scripted HTTP server standing in for vLLM, SGLang or llama.cpp's server in tests:
/v1/models, /metrics from fixture texts (in order, the last one repeated), a scripted OpenAI
chat stream, and /detokenize and /tokenize when given functions for them. It records what
clients did (chat bodies, streams in flight, streams the client closed early) and can be stopped
and started again on the same port (a restart).
"""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures"
OWNED_BY = {"vllm": "vllm", "sglang": "sglang", "llamacpp": "llamacpp", "kvscope": "kvscope"}


def fixture_texts(name: str) -> list[str]:
    return [(FIXTURES / f"{name}.{i}.prom").read_text() for i in (1, 2)]


@dataclass
class ChatScript:
    words: list[str] = field(default_factory=lambda: ["Hello", " from", " the", " server", "."])
    delay: float = 0.01  # seconds between chunks
    first_delay: float = 0.0  # before the first content chunk
    usage: dict | None = field(default_factory=lambda: {
        "prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17,
        "prompt_tokens_details": {"cached_tokens": 8}})
    finish_reason: str = "stop"
    cut_after: int | None = None  # close the connection after this many chunks, no [DONE]
    error_event: str | None = None  # send an error event after the chunks instead of finishing
    status: int = 200  # an HTTP error instead of a stream


class FakeServer:
    def __init__(self, kind: str = "vllm", metrics: list[str] | None = None, *,
                 api_key: str | None = None, model: str = "fake-model",
                 chat: ChatScript | None = None) -> None:
        self.kind = kind
        self.metrics = list(metrics or [])
        self.metrics_status = 200
        self.metrics_delay = 0.0
        self.metrics_raw: bytes | None = None  # served instead of the texts (garbage, huge)
        self.models_body: bytes | None = None  # served instead of the model list
        self.api_key = api_key
        self.model = model
        self.chat = chat or ChatScript()
        # POST /detokenize {"tokens": [...]} -> {"prompt": detokenize(tokens)}; None: 404
        self.detokenize: Callable[[list[int]], str] | None = None
        self.detokenize_bodies: list[dict] = []
        # POST /tokenize {"prompt": text} -> vLLM's {"count", "max_model_len", "tokens",
        # "token_strs"} with tokenize(text); None: 404
        self.tokenize: Callable[[str], list[int]] | None = None
        self.tokenize_bodies: list[dict] = []
        self.lock = threading.Lock()
        self.metrics_requests = 0
        self.metrics_in_flight = 0  # scrapes being answered right now
        self.chat_bodies: list[dict] = []
        self.streams_open = 0
        self.max_streams_open = 0
        self.streams_closed_by_client = 0
        self.port = 0
        self.httpd: http.server.ThreadingHTTPServer | None = None

    # --- life ------------------------------------------------------------------------------
    def start(self) -> FakeServer:
        server = self

        class Handler(_Handler):
            fake = server

        httpd = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        httpd.daemon_threads = True
        self.port = httpd.server_address[1]
        self.httpd = httpd
        threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05},
                         daemon=True).start()
        return self

    def stop(self) -> None:
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
            self.httpd = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FakeServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class _Handler(http.server.BaseHTTPRequestHandler):
    fake: FakeServer

    def log_message(self, *args) -> None:
        pass

    def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except OSError:
            pass

    def _authorized(self) -> bool:
        key = self.fake.api_key
        if key is None or self.headers.get("authorization") == f"Bearer {key}":
            return True
        self._send(401, json.dumps({"error": {"message": "Invalid API key", "type": "auth",
                                              "code": 401}}).encode())
        return False

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        f = self.fake
        if self.path == "/metrics":
            with f.lock:
                i = f.metrics_requests
                f.metrics_requests += 1
                f.metrics_in_flight += 1
            try:
                self._send_metrics(i)
            finally:
                with f.lock:
                    f.metrics_in_flight -= 1
            return
        self._get_other()

    def _send_metrics(self, i: int) -> None:
        f = self.fake
        if f.metrics_delay:
            time.sleep(f.metrics_delay)
        if f.metrics_status != 200:
            self._send(f.metrics_status, b"not found", "text/plain")
        elif f.metrics_raw is not None:
            self._send(200, f.metrics_raw, "text/plain")
        elif f.metrics:
            text = f.metrics[min(i, len(f.metrics) - 1)]
            self._send(200, text.encode(), "text/plain; version=0.0.4")
        else:
            self._send(404, b"no metrics", "text/plain")

    def _get_other(self) -> None:
        f = self.fake
        if self.path == "/v1/models":
            if not self._authorized():
                return
            body = f.models_body or json.dumps({"object": "list", "data": [{
                "id": f.model, "object": "model", "created": 0,
                "owned_by": OWNED_BY.get(f.kind, "someone")}]}).encode()
            self._send(200, body)
            return
        self._send(404, b'{"detail": "Not Found"}')

    def do_POST(self) -> None:  # noqa: N802
        f = self.fake
        if self.path == "/detokenize" and f.detokenize is not None:
            self._detokenize()
            return
        if self.path == "/tokenize" and f.tokenize is not None:
            self._tokenize()
            return
        if self.path != "/v1/chat/completions":
            self._send(404, b'{"detail": "Not Found"}')
            return
        if not self._authorized():
            return
        body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
        script = f.chat
        with f.lock:
            f.chat_bodies.append(body)
        if script.status != 200:
            self._send(script.status, json.dumps({"error": {"message": "scripted failure",
                                                             "type": "x"}}).encode())
            return
        max_tokens = int(body.get("max_tokens") or len(script.words))
        words = script.words[:max_tokens]
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("connection", "close")
        self.end_headers()
        with f.lock:
            f.streams_open += 1
            f.max_streams_open = max(f.max_streams_open, f.streams_open)
        closed_by_client = False
        try:
            self._stream(script, words)
        except OSError:  # the client closed the stream
            closed_by_client = True
        finally:
            with f.lock:  # both at once: a reader never sees one counted without the other
                f.streams_closed_by_client += closed_by_client
                f.streams_open -= 1
        self.close_connection = True

    def _detokenize(self) -> None:
        f = self.fake
        body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
        with f.lock:
            f.detokenize_bodies.append(body)
        assert f.detokenize is not None
        self._send(200, json.dumps({"prompt": f.detokenize(body["tokens"])}).encode())

    def _tokenize(self) -> None:
        f = self.fake
        body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
        with f.lock:
            f.tokenize_bodies.append(body)
        assert f.tokenize is not None
        tokens = f.tokenize(body["prompt"])
        self._send(200, json.dumps({"count": len(tokens), "max_model_len": 4096,
                                    "tokens": tokens, "token_strs": None}).encode())

    def _event(self, obj: dict | str) -> None:
        data = obj if isinstance(obj, str) else json.dumps(obj)
        self.wfile.write(f"data: {data}\n\n".encode())
        self.wfile.flush()

    def _stream(self, script: ChatScript, words: list[str]) -> None:
        base = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0,
                "model": self.fake.model}
        self._event(base | {"choices": [{"index": 0, "delta": {"role": "assistant",
                                                                 "content": ""}}]})
        if script.first_delay:
            time.sleep(script.first_delay)
        for i, w in enumerate(words):
            if script.cut_after is not None and i >= script.cut_after:
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            if i:
                time.sleep(script.delay)
            self._event(base | {"choices": [{"index": 0, "delta": {"content": w},
                                             "finish_reason": None}]})
        time.sleep(script.delay)  # a client that closed shows up on the next write
        if script.error_event:
            self._event({"error": {"message": script.error_event, "type": "server_error"}})
            return
        self._event(base | {"choices": [{"index": 0, "delta": {},
                                         "finish_reason": script.finish_reason}]})
        if script.usage is not None:
            self._event(base | {"choices": [], "usage": script.usage})
        self._event("[DONE]")
