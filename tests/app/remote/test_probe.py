"""app/remote/probe.py and the async chat stream against a scripted HTTP server (no engine):
what is behind a URL, and every way a server can answer badly."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from app.remote.kvscope_http import RemoteError
from app.remote.metrics import MAX_METRICS_BYTES, MetricsError
from app.remote.openai_client import ChatDelta, ReplyStats, astream_chat
from app.remote.probe import discover, fetch_metrics_text, normalize_url
from tests.app.remote.fake_server import ChatScript, FakeServer, fixture_texts


def run(coro):
    return asyncio.run(coro)


async def _discover(url: str, key: str | None = None, **kw):
    async with httpx.AsyncClient() as http:
        return await discover(http, url, key, **kw)


def test_normalize_url() -> None:
    assert normalize_url("http://h:8000/v1/") == "http://h:8000"
    assert normalize_url(" localhost:8000 ") == "http://localhost:8000"
    assert normalize_url("https://h/api/v1") == "https://h/api"
    for bad, why in (("", "empty"), ("ftp://h", "http"), ("http://", "host"),
                     ("http://h:99999", "port")):
        with pytest.raises(ValueError, match=why):
            normalize_url(bad)


@pytest.mark.parametrize("name,kind", [("vllm_v1", "vllm"), ("vllm_v0", "vllm"),
                                       ("sglang", "sglang"), ("llamacpp", "llamacpp")])
def test_kind_from_the_metric_prefixes(name: str, kind: str) -> None:
    with FakeServer("someone-else", fixture_texts(name)) as fake:  # owned_by says nothing
        info = run(_discover(fake.url))
    assert info.kind == kind and info.model == "fake-model" and info.metrics_note == ""
    assert info.first_scrape is not None and info.missing == info.first_scrape.missing
    assert not info.per_block


def test_kind_from_owned_by_without_metrics() -> None:
    with FakeServer("llamacpp", []) as fake:  # /metrics: 404 (llama.cpp without --metrics)
        info = run(_discover(fake.url))
    assert info.kind == "llamacpp" and info.first_scrape is None
    assert "404" in info.metrics_note and len(info.missing) == 10


def test_refusals_are_clear() -> None:
    with FakeServer("vllm", fixture_texts("vllm_v1"), api_key="right") as fake:
        with pytest.raises(RemoteError, match="refused the API key"):
            run(_discover(fake.url, "wrong"))
        assert run(_discover(fake.url, "right")).kind == "vllm"
        fake.models_body = b"<html>it works</html>"
        with pytest.raises(RemoteError, match="not an OpenAI-compatible server"):
            run(_discover(fake.url, "right"))
    with pytest.raises(RemoteError, match="cannot reach"):
        run(_discover(fake.url))  # stopped: nothing listens there any more


def test_garbage_huge_and_slow_metrics() -> None:
    with FakeServer("vllm", fixture_texts("vllm_v1")) as fake:
        fake.metrics_raw = b'vllm:num_requests_running{model_name="x" 1\n'
        info = run(_discover(fake.url))
        assert info.kind == "vllm" and "not Prometheus text" in info.metrics_note
        fake.metrics_raw = b"\xff\xfe" * 10
        assert "not text" in run(_discover(fake.url)).metrics_note
        fake.metrics_raw = b"#" * (MAX_METRICS_BYTES + 10)

        async def huge():
            async with httpx.AsyncClient() as http:
                await fetch_metrics_text(http, fake.url, None, timeout=10)

        with pytest.raises(MetricsError, match="limit"):
            run(huge())
        fake.metrics_raw = None
        fake.metrics_delay = 1.0
        info = run(_discover(fake.url, metrics_timeout=0.3))
        assert "did not answer within 0.3 s" in info.metrics_note
        assert info.kind == "vllm"  # gave up on /metrics, not on the server


async def _chat(url: str, body: dict | None = None) -> tuple[list, ReplyStats]:
    stats = ReplyStats(start=time.monotonic())
    async with httpx.AsyncClient() as http:
        events = [e async for e in astream_chat(http, url, None, body or {"messages": []},
                                                stats)]
    return events, stats


def test_async_chat_stream() -> None:
    with FakeServer("vllm", [], chat=ChatScript(words=["a", "b", "c"])) as fake:
        events, stats = run(_chat(fake.url))
        assert "".join(e.text for e in events if isinstance(e, ChatDelta)) == "abc"
        assert stats.finish_reason == "stop" and stats.response_id == "chatcmpl-fake"
        assert stats.usage is not None and stats.usage.cached_tokens == 8
        assert fake.chat_bodies[-1]["stream"] is True
        fake.chat = ChatScript(words=["a", "b", "c"], usage={"prompt_tokens": 3,
                                                             "completion_tokens": 3})
        _, stats = run(_chat(fake.url))
        assert stats.usage.cached_tokens is None  # not reported: unknown, not 0


@pytest.mark.parametrize("script,match,status", [
    (ChatScript(cut_after=2), "before the reply was complete|broke off", None),
    (ChatScript(error_event="out of KV cache"), "reported an error: out of KV cache", None),
    (ChatScript(status=500), "HTTP 500: scripted failure", 500),
])
def test_async_chat_failures(script: ChatScript, match: str, status: int | None) -> None:
    with FakeServer("vllm", [], chat=script) as fake:
        with pytest.raises(RemoteError, match=match) as err:
            run(_chat(fake.url))
    assert err.value.status == status


def test_cancelling_closes_the_stream() -> None:
    with FakeServer("vllm", [], chat=ChatScript(words=["w"] * 500, delay=0.02)) as fake:

        async def some_then_cancel() -> int:
            got = 0

            async def consume() -> None:
                nonlocal got
                async for e in astream_chat(http, fake.url, None, {"messages": []},
                                            ReplyStats(start=0.0)):
                    got += isinstance(e, ChatDelta)

            async with httpx.AsyncClient() as http:
                task = asyncio.create_task(consume())
                while got < 3:
                    await asyncio.sleep(0.01)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            return got

        assert 3 <= run(some_then_cancel()) < 500
        deadline = time.monotonic() + 10
        while fake.streams_closed_by_client == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert fake.streams_closed_by_client == 1 and fake.streams_open == 0
