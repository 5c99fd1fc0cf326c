"""Load on the HTTP front-end: 256 concurrent streams, 1,000 idle keep-alive connections and a
client that sends its headers one byte at a time, at once. Everyone else keeps being served,
every stream ends with [DONE], and the front-end's memory stays bounded."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest

from tests.app.api.helpers import ServeProc
from tests.soak.procs import proc_stats

pytestmark = pytest.mark.slow

STREAMS = 256
IDLE = 1000
RSS_GROWTH_LIMIT_KB = 200 * 1024


def idle_connections(host: str, port: int, n: int) -> list[socket.socket]:
    """Connections that made one request and stay open (HTTP/1.1 keep-alive)."""
    socks = []
    for _ in range(n):
        s = socket.create_connection((host, port), timeout=30)
        s.sendall(f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        socks.append(s)
    for s in socks:
        assert s.recv(4096).startswith(b"HTTP/1.1 200"), "an idle client was not served"
    return socks


def slow_headers(host: str, port: int, stop: threading.Event) -> None:
    with socket.create_connection((host, port), timeout=30) as s:
        request = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nX-Slow: " + "a" * 200
        for ch in request:
            if stop.is_set():
                return
            s.sendall(ch.encode())
            time.sleep(0.05)


async def streams(url: str, n: int) -> list[tuple[str, bool]]:
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as http:

        async def one(i: int) -> tuple[str, bool]:
            body = {"prompt": f"stream {i}", "max_tokens": 16, "temperature": 0, "stream": True}
            text, done = [], False
            async with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200, await r.aread()
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: ") and '"error"' not in line:
                        text.append(json.loads(line[6:])["choices"][0]["text"])
            return "".join(text), done

        return await asyncio.gather(*(one(i) for i in range(n)))


def test_many_streams_idle_connections_and_a_slow_client_at_once() -> None:
    serve = ServeProc(
        ["--port", "0", "--max-pending", "512", "--engine-args",
         "--engine-factory tests.ipc.engines:tiny --num-threads 1 --max-num-seqs 64"]
    )  # fmt: skip
    stop = threading.Event()
    idle: list[socket.socket] = []
    try:
        serve.wait_healthy(120)
        host, port = serve.url.removeprefix("http://").rsplit(":", 1)
        before = proc_stats(serve.proc.pid)
        idle = idle_connections(host, int(port), IDLE)
        slow = threading.Thread(target=slow_headers, args=(host, int(port), stop), daemon=True)
        slow.start()
        results = asyncio.run(streams(serve.url, STREAMS))
        assert all(done for _, done in results), "a stream ended without [DONE]"
        assert all(text for text, _ in results)
        # Served while all of that is open: a fresh client gets its answer.
        r = httpx.post(serve.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200
        after = proc_stats(serve.proc.pid)
        assert after.rss_kb - before.rss_kb < RSS_GROWTH_LIMIT_KB, (before, after)
        # The idle connections are still being served.
        idle[0].sendall(f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        assert idle[0].recv(4096).startswith(b"HTTP/1.1 200")
    finally:
        stop.set()
        for s in idle:
            s.close()
        serve.stop()
