"""Chat with any OpenAI-compatible server over HTTP (vLLM, SGLang, llama.cpp's server, Ollama,
LM Studio, KVScope): streamed replies with their timing, for the window's worker thread.

`stream_chat` is synchronous (httpx.Client); `astream_chat` is the same over httpx.AsyncClient
for the window's worker thread, which runs many streams (chats, the load generator) on one asyncio
loop. Either way closing the response stops the reply (the server sees the disconnect and aborts
the request).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from app.remote.kvscope_http import RemoteError, auth_headers


@dataclass(slots=True)
class ChatDelta:
    index: int
    text: str
    time: float  # time.monotonic() at arrival


@dataclass(slots=True)
class ChatFinish:
    index: int
    reason: str | None
    time: float


@dataclass(slots=True)
class ChatUsage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None  # None: the server does not report it


@dataclass(slots=True)
class ReplyStats:
    """What the window prints under a reply: from the stream's own timing."""

    start: float
    first_token: float | None = None
    end: float | None = None
    num_chunks: int = 0
    usage: ChatUsage | None = None
    finish_reason: str | None = None
    errors: list[str] = field(default_factory=list)
    response_id: str | None = None  # the chunks' "id" (chatcmpl-...), once one arrived

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    @property
    def tokens_per_second(self) -> float | None:
        """Completion tokens (from usage when reported, else content chunks) after the first,
        over the time after the first."""
        if self.first_token is None or self.end is None or self.end <= self.first_token:
            return None
        tokens = self.usage.completion_tokens if self.usage else self.num_chunks
        return (tokens - 1) / (self.end - self.first_token) if tokens > 1 else None


def list_models(base_url: str, api_key: str | None, timeout: float = 10.0) -> list[dict]:
    """GET /v1/models; RemoteError when the answer is not the OpenAI shape."""
    try:
        r = httpx.get(base_url + "/v1/models", headers=auth_headers(api_key), timeout=timeout)
    except httpx.HTTPError as exc:
        raise RemoteError(f"cannot reach {base_url}: {describe(exc)}") from None
    return _models_of(r, base_url)


async def alist_models(http: httpx.AsyncClient, base_url: str, api_key: str | None,
                       timeout: float = 10.0) -> list[dict]:
    """`list_models` over an AsyncClient."""
    try:
        r = await http.get(base_url + "/v1/models", headers=auth_headers(api_key),
                           timeout=timeout)
    except httpx.HTTPError as exc:
        raise RemoteError(f"cannot reach {base_url}: {describe(exc)}") from None
    return _models_of(r, base_url)


def _models_of(r: httpx.Response, base_url: str) -> list[dict]:
    if r.status_code == 401:
        raise RemoteError("the server refused the API key (401)", 401)
    try:
        data = r.json()["data"]
        assert isinstance(data, list) and all(isinstance(m, dict) and "id" in m for m in data)
    except (ValueError, KeyError, TypeError, AssertionError):
        raise RemoteError(
            f"{base_url} is not an OpenAI-compatible server (GET /v1/models answered "
            f"HTTP {r.status_code}: {r.text[:120]!r})", r.status_code
        ) from None
    return data


def describe(exc: Exception) -> str:
    """An httpx error in words (some have an empty str())."""
    return str(exc) or type(exc).__name__


def stream_chat(
    http: httpx.Client,
    base_url: str,
    api_key: str | None,
    body: dict[str, Any],
    stats: ReplyStats,
) -> Iterator[ChatDelta | ChatFinish]:
    """POST /v1/chat/completions with stream=true; yields deltas and finishes, fills `stats`.
    RemoteError for an HTTP error, an error event, or a stream cut before [DONE]."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    headers = {**auth_headers(api_key), "content-type": "application/json"}
    with http.stream("POST", base_url + "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code >= 400:
            r.read()
            raise RemoteError(_error_text(r), r.status_code)
        done = False
        try:
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    done = True
                    break
                yield from _events(_json_chunk(payload), stats)
        except httpx.HTTPError as exc:
            raise RemoteError(f"the stream broke off: {exc}") from None
        finally:
            stats.end = time.monotonic()
        if not done:
            raise RemoteError("the stream ended before the reply was complete (no [DONE])")


async def astream_chat(
    http: httpx.AsyncClient,
    base_url: str,
    api_key: str | None,
    body: dict[str, Any],
    stats: ReplyStats,
) -> AsyncIterator[ChatDelta | ChatFinish]:
    """`stream_chat` over an AsyncClient. Cancelling the consumer closes the stream."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    headers = {**auth_headers(api_key), "content-type": "application/json"}
    try:
        async with http.stream(
            "POST", base_url + "/v1/chat/completions", json=body, headers=headers
        ) as r:
            if r.status_code >= 400:
                await r.aread()
                raise RemoteError(_error_text(r), r.status_code)
            done = False
            try:
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        done = True
                        break
                    try:
                        events = list(_events(_json_chunk(payload), stats))
                    except (TypeError, ValueError, AttributeError) as exc:
                        raise RemoteError(f"the stream sent a malformed chunk: {exc}") from None
                    for event in events:
                        yield event
            finally:
                stats.end = time.monotonic()
            if not done:
                raise RemoteError("the stream ended before the reply was complete (no [DONE])")
    except httpx.ConnectError as exc:
        raise RemoteError(f"cannot reach {base_url}: {describe(exc)}") from None
    except httpx.HTTPError as exc:
        raise RemoteError(f"the stream broke off: {describe(exc)}") from None


def _json_chunk(payload: str) -> dict[str, Any]:
    try:
        chunk = json.loads(payload)
    except ValueError:
        raise RemoteError(f"the stream sent something that is not JSON: {payload[:80]!r}") from None
    if not isinstance(chunk, dict):
        raise RemoteError(f"the stream sent a JSON {type(chunk).__name__}, not a chunk object")
    return chunk


def _events(chunk: dict[str, Any], stats: ReplyStats) -> Iterator[ChatDelta | ChatFinish]:
    now = time.monotonic()
    if stats.response_id is None and isinstance(chunk.get("id"), str):
        stats.response_id = chunk["id"]
    if "error" in chunk:
        err = chunk["error"]
        message = err.get("message", err) if isinstance(err, dict) else err
        raise RemoteError(f"the server reported an error: {message}")
    usage = chunk.get("usage")
    if usage:
        details = usage.get("prompt_tokens_details") or {}
        stats.usage = ChatUsage(
            int(usage.get("prompt_tokens", 0)),
            int(usage.get("completion_tokens", 0)),
            details.get("cached_tokens"),
        )
    for choice in chunk.get("choices") or []:
        index = int(choice.get("index", 0))
        text = (choice.get("delta") or {}).get("content") or ""
        if text:
            stats.num_chunks += 1
            if stats.first_token is None:
                stats.first_token = now
            yield ChatDelta(index, text, now)
        if choice.get("finish_reason"):
            stats.finish_reason = choice["finish_reason"]
            yield ChatFinish(index, choice["finish_reason"], now)


def _error_text(r: httpx.Response) -> str:
    try:
        message = r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = r.text[:200]
    if r.status_code == 401:
        return f"the server refused the API key (401): {message}"
    return f"HTTP {r.status_code}: {message}"
