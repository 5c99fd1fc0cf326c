"""One API call's engine requests: start them, merge their replies, abort what is left.

A completions call with several prompts becomes one engine request per prompt (each with the
call's `n`); their Delta and Finish messages arrive on one queue tagged with the prompt index.
`close()` aborts every engine request that has not finished, so a client that goes away frees
its KV blocks within one engine step.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator

from app.api.errors import APIError
from app.api.requests import GenerationPlan
from ipc import protocol as P
from ipc.async_client import AsyncEngineClient, AsyncRequestStream
from ipc.client import ERR_ENGINE_GONE, EngineError

Event = tuple[int, P.Delta | P.Finish]


class Generation:
    def __init__(self, client: AsyncEngineClient, plan: GenerationPlan, origin_id: str) -> None:
        self.client = client
        self.plan = plan
        self.origin_id = origin_id
        self.streams: list[AsyncRequestStream] = []
        self.queue: asyncio.Queue[tuple[int, P.Delta | P.Finish | EngineError]] = asyncio.Queue()
        self._pumps: list[asyncio.Task[None]] = []
        self._open = 0  # streams not yet at their last Finish
        self._finishes: list[int] = []  # Finish messages consumed, per stream

    async def start(self) -> None:
        """Send every engine request; a refusal arrives later as an EngineError event."""
        base = f"{self.origin_id}-{uuid.uuid4().hex[:8]}"
        prompts: list[str | list[int] | None] = (
            [None] if self.plan.kind == "chat" else list(self.plan.prompts)
        )
        for i, prompt in enumerate(prompts):
            msg_size_check(prompt, self.plan)
            stream = await self.client.generate(
                f"{base}-{i}" if len(prompts) > 1 else base,
                prompt=prompt,
                messages=self.plan.messages if prompt is None else None,
                sampling=self.plan.sampling,
                cache_salt=self.plan.cache_salt,
                tools=rendered_tools(self.plan),
                chat_template_kwargs=self.plan.chat_template_kwargs,
            )
            self.streams.append(stream)
            self._finishes.append(0)
            self._open += 1
            self._pumps.append(asyncio.create_task(self._pump(i, stream)))

    async def _pump(self, index: int, stream: AsyncRequestStream) -> None:
        try:
            async for msg in stream:
                self.queue.put_nowait((index, msg))
        except EngineError as exc:
            self.queue.put_nowait((index, exc))

    async def events(self) -> AsyncIterator[Event]:
        """Every Delta and Finish of every prompt, in arrival order; raises APIError when the
        engine refuses a request, goes away, or ends a sequence with abort/error."""
        while self._open:
            index, msg = await self.queue.get()
            if isinstance(msg, EngineError):
                raise api_error_of(msg)
            if isinstance(msg, P.Finish):
                if msg.reason in ("abort", "error"):
                    raise api_error_of_finish(msg)
                # Count what this consumer saw: the pump may already be further ahead.
                self._finishes[index] += 1
                if self._finishes[index] == self.plan.sampling.n:
                    self._open -= 1
            yield index, msg

    async def close(self) -> None:
        for task in self._pumps:
            task.cancel()
        for stream in self.streams:
            if not stream.done:
                with contextlib.suppress(EngineError, Exception):
                    await stream.abort()


def rendered_tools(plan: GenerationPlan) -> list[dict] | None:
    """The tools the template shows the model: none under tool_choice "none" (the caller wants
    prose; app/api/tools/request.py)."""
    return plan.tools if plan.tool_choice != "none" else None


def msg_size_check(prompt: str | list[int] | None, plan: GenerationPlan) -> None:
    """The engine drops (with the connection) any frame over 1 MiB: refuse such prompts here."""
    msg = P.Generate(
        request_id="x" * 48,
        prompt=prompt,
        messages=plan.messages if prompt is None else None,
        sampling=plan.sampling,
        cache_salt=plan.cache_salt,
        tools=rendered_tools(plan),
        chat_template_kwargs=plan.chat_template_kwargs,
    )
    size = len(P.encode(msg))
    if size > P.MAX_CLIENT_MESSAGE_BYTES:
        raise APIError(
            413,
            f"the request needs a {size}-byte engine message; the engine accepts at most "
            f"{P.MAX_CLIENT_MESSAGE_BYTES} bytes",
            code="request_too_large",
        )


def api_error_of(exc: EngineError) -> APIError:
    code = exc.code
    if code in (P.ERR_INVALID_REQUEST, P.ERR_INVALID_MESSAGE):
        context = "context limit" in exc.message or "max_model_len" in exc.message
        return APIError(
            400, exc.message, code="context_length_exceeded" if context else "invalid_value"
        )
    if code == P.ERR_OVERLOADED:
        return APIError(
            429, f"the engine is overloaded: {exc.message}", headers={"retry-after": "1"}
        )
    if code in (P.ERR_SHUTTING_DOWN, ERR_ENGINE_GONE, "client_closed"):
        return APIError(
            503, f"the engine is not available: {exc.message}", code="engine_unavailable"
        )
    return APIError(500, f"engine error [{code}]: {exc.message}", code=code)


def api_error_of_finish(finish: P.Finish) -> APIError:
    why = finish.error or finish.reason
    if finish.reason == "abort":
        return APIError(503, f"the request was aborted: {why}", code="engine_unavailable")
    return APIError(500, f"the engine failed this request: {why}", code="engine_error")
