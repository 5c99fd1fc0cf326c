"""Server-sent events: the stream of one API call, ended the moment its client disconnects."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from fastapi.responses import Response
from starlette.types import Receive, Scope, Send

from app.api.errors import APIError
from app.api.generation import Generation
from app.api.responses import Reply
from ipc import protocol as P


def sse(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class SSEResponse(Response):
    """A streamed body (server-sent events by default) that ends its producer the moment the
    client disconnects (whatever the ASGI server's spec version), then runs `on_close` (which
    aborts engine requests)."""

    def __init__(
        self,
        events: AsyncIterator[bytes],
        on_close: Callable[[], Awaitable[None]],
        media_type: str = "text/event-stream",
    ) -> None:
        super().__init__(content=None, media_type=media_type)
        self.headers["cache-control"] = "no-cache"
        self.headers["x-accel-buffering"] = "no"
        del self.headers["content-length"]
        self.events = events
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        producer = asyncio.create_task(self._pump(send))
        listener = asyncio.create_task(wait_disconnect(receive))
        try:
            await asyncio.wait({producer, listener}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (producer, listener):
                task.cancel()
            for task in (producer, listener):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            await self.on_close()

    async def _pump(self, send: Send) -> None:
        async for chunk in self.events:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def first_events(gen: Generation) -> list[tuple[int, Any]]:
    """Wait for the first message of every engine request, so that a refused request (bad
    values, prompt too long) still gets its 4xx status before the stream starts."""
    seen: set[int] = set()
    first: list[tuple[int, Any]] = []
    events = gen.events()
    while len(seen) < len(gen.streams):
        try:
            index, msg = await anext(events)
        except StopAsyncIteration:
            break
        seen.add(index)
        first.append((index, msg))
    return first


async def stream_chunks(
    reply: Reply, gen: Generation, first: list[tuple[int, Any]]
) -> AsyncIterator[bytes]:
    started: set[int] = set()
    offsets = [0] * len(reply.choices)

    def chunks(index: int, msg: P.Delta | P.Finish) -> list[bytes]:
        choice = reply.add(index, msg)
        out = []
        if reply.plan.kind == "chat" and choice.index not in started:
            started.add(choice.index)
            out.append(sse(reply.role_chunk(choice)))
        if choice.reader is not None:  # chat: what the choice's reader made of it
            delta = msg if isinstance(msg, P.Delta) else None
            out.extend(sse(c) for c in reply.event_chunks(choice, delta))
            if isinstance(msg, P.Finish):
                out.append(sse(reply.finish_chunk(choice)))
        elif isinstance(msg, P.Delta):
            if msg.text or msg.logprobs:
                out.append(sse(reply.delta_chunk(choice, msg, offsets[choice.index])))
                offsets[choice.index] += len(msg.text)
        else:
            out.append(sse(reply.finish_chunk(choice)))
        return out

    try:
        for index, msg in first:
            for chunk in chunks(index, msg):
                yield chunk
        async for index, msg in gen.events():
            for chunk in chunks(index, msg):
                yield chunk
        if reply.plan.include_usage:
            yield sse(reply.usage_chunk())
    except APIError as exc:
        yield sse(exc.body())
    yield SSE_DONE
