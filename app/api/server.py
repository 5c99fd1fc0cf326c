"""The ASGI app of the OpenAI-compatible API: security first, then bounded work, then routes.

Order of checks for every request: the Host header (on loopback binds it must name a loopback
host: DNS rebinding against local LLM servers is a known attack), the API key (everything but
/health, /metrics and /version), then the body (JSON only, bounded size). Work is bounded too:
at most `max_pending` calls in flight (429 with retry-after beyond), and every engine request of
a call that ends early (client gone, error) is aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from app.api import requests as R
from app.api.errors import APIError, error_body
from app.api.generation import Generation, api_error_of
from app.api.metrics import render as render_metrics
from app.api.responses import Reply
from ipc import protocol as P
from ipc.async_client import AsyncEngineClient
from ipc.client import EngineError

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})


@dataclass(slots=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: list[str] = field(default_factory=list)  # empty: no key needed
    served_model_names: list[str] = field(default_factory=list)  # empty: the engine's name
    max_body_bytes: int = 1 << 20
    max_pending: int = 256  # API calls in flight
    max_n: int = 16
    max_tokens: int | None = None  # per sequence; None: max_model_len
    cors_origins: list[str] = field(default_factory=list)
    allowed_hosts: list[str] = field(default_factory=list)  # extra Host names on loopback

    @property
    def loopback(self) -> bool:
        return is_loopback_host(self.host)


def is_loopback_host(host: str) -> bool:
    h = host.strip("[]").lower()
    return h in ("localhost", "::1") or h.startswith("127.")


class EngineLink:
    """The engine as the API sees it: loading, ready (a connected client) or gone."""

    def __init__(self) -> None:
        self.client: AsyncEngineClient | None = None
        self.status = "loading"  # loading | ready | gone
        self.detail = "the model is loading"
        self.progress = 0.0

    @property
    def telemetry(self) -> P.Telemetry | None:
        return None if self.client is None else self.client.telemetry

    @property
    def model_info(self) -> P.ModelInfo:
        assert self.client is not None
        return self.client.model_info

    def ready_client(self) -> AsyncEngineClient:
        client = self.client
        if self.status == "ready" and client is not None and client.state != "ready":
            self.status, self.detail = "gone", client.gone_reason or "the engine went away"
        if self.status != "ready" or client is None:
            raise APIError(
                503, f"the engine is not ready: {self.detail}", code="engine_unavailable"
            )
        return client

    async def attach(self, endpoint: str, token: str | None, timeout: float = 30.0) -> None:
        client = AsyncEngineClient(endpoint, token=token, client_name="http")
        await client.connect(timeout)
        old, self.client = self.client, client
        self.status, self.detail = "ready", "serving"
        if old is not None:
            await old.close()

    def mark_gone(self, why: str) -> None:
        self.status, self.detail = "gone", why


# ------------------------------------------------------------------ security and limits


class GuardMiddleware:
    """Host check, then API key, before any route runs (pure ASGI: no per-request task)."""

    def __init__(self, app: ASGIApp, settings: ServerSettings) -> None:
        self.app = app
        self.settings = settings
        self.key_digests = [hashlib.sha256(k.encode()).digest() for k in settings.api_keys]
        self.allowed = {h.lower() for h in settings.allowed_hosts} | LOOPBACK_HOSTS

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        error = self._check(scope, headers)
        if error is not None:
            await _send_json(send, error.status, error.body(), error.headers)
            return
        await self.app(scope, receive, send)

    def _check(self, scope: Scope, headers: dict[str, str]) -> APIError | None:
        if self.settings.loopback:
            host = _host_name(headers.get("host", ""))
            if host not in self.allowed:
                return APIError(
                    403,
                    f"Host header {headers.get('host', '')!r} is not allowed: this server listens "
                    "on loopback and answers only Host localhost, 127.0.0.1 or [::1] "
                    "(--allowed-host adds names)",
                    code="host_not_allowed",
                )
        path = scope["path"]
        if self.key_digests and path not in OPEN_PATHS and scope["method"] != "OPTIONS":
            auth = headers.get("authorization", "")
            scheme, _, given = auth.partition(" ")
            if not given and "x-api-key" in headers:
                scheme, given = "bearer", headers["x-api-key"]
            digest = hashlib.sha256(given.strip().encode()).digest()
            ok = scheme.lower() == "bearer" and any(
                secrets.compare_digest(digest, d) for d in self.key_digests
            )
            if not ok:
                return APIError(
                    401,
                    "missing or wrong API key: send 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                    headers={"www-authenticate": "Bearer"},
                )
        return None


def _host_name(host: str) -> str:
    host = host.strip().lower()
    if host.startswith("["):
        return host[: host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


async def _send_json(
    send: Send, status: int, body: Any, headers: dict[str, str] | None = None
) -> None:
    data = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": data})


async def read_json(request: Request, max_bytes: int) -> Any:
    """The JSON body: 415 when it is not JSON, 413 over the limit, 400 when it does not parse."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":
        raise APIError(415, f"Content-Type must be application/json, got {ctype or 'none'!r}")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise APIError(413, f"the body has {declared} bytes; the limit is {max_bytes}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise APIError(413, f"the body is over the limit of {max_bytes} bytes")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None


# ------------------------------------------------------------------ streaming


def sse(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class SSEResponse(Response):
    """Server-sent events that end their producer the moment the client disconnects (whatever
    the ASGI server's spec version), then run `on_close` (which aborts engine requests)."""

    media_type = "text/event-stream"

    def __init__(
        self, events: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]]
    ) -> None:
        super().__init__(content=None, media_type=self.media_type)
        self.headers["cache-control"] = "no-cache"
        self.headers["x-accel-buffering"] = "no"
        del self.headers["content-length"]
        self.events = events
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        producer = asyncio.create_task(self._pump(send))
        listener = asyncio.create_task(_wait_disconnect(receive))
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


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


# ------------------------------------------------------------------ the app


def create_app(settings: ServerSettings, link: EngineLink) -> FastAPI:
    app = FastAPI(title="KVScope OpenAI-compatible API", docs_url=None, redoc_url=None,
                  openapi_url=None)  # fmt: skip
    app.state.settings = settings
    app.state.link = link
    app.state.in_flight = 0
    if settings.cors_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["authorization", "content-type"],
        )
    app.add_middleware(GuardMiddleware, settings=settings)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return JSONResponse(error_body(exc.status_code, message), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def on_bug(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error on %s", request.url.path)
        return JSONResponse(error_body(500, f"internal server error: {exc}"), status_code=500)

    def served_names() -> list[str]:
        return settings.served_model_names or [default_model_id(link.model_info.name)]

    def limits() -> R.Limits:
        info = link.model_info
        return R.Limits(
            max_model_len=info.max_model_len,
            max_tokens=settings.max_tokens or info.max_model_len,
            max_n=settings.max_n,
        )

    @app.get("/health")
    async def health() -> Response:
        if link.status == "ready" and link.client is not None and link.client.state == "ready":
            return Response(status_code=200)
        try:
            link.ready_client()
        except APIError as exc:
            return JSONResponse(exc.body(), status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        try:
            v = metadata.version("kvscope")
        except metadata.PackageNotFoundError:
            v = "unknown"
        return {"version": v}

    @app.get("/metrics")
    async def metrics() -> Response:
        if link.client is None:
            return Response(b"", media_type="text/plain; version=0.0.4; charset=utf-8")
        body = render_metrics(link, served_names()[0])
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        link.ready_client()
        info = link.model_info
        created = int(time.time())
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": created,
                    "owned_by": "kvscope",
                    "root": info.name,
                    "max_model_len": info.max_model_len,
                }
                for name in served_names()
            ],
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await read_json(request, settings.max_body_bytes)
        link.ready_client()
        plan = R.parse_chat(body, limits())
        return await run_plan(request, plan)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await read_json(request, settings.max_body_bytes)
        link.ready_client()
        plan = R.parse_completion(body, limits())
        return await run_plan(request, plan)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await read_json(request, settings.max_body_bytes)
        client = link.ready_client()
        args = R.parse_tokenize(body)
        R.check_model(_model_field(body), served_names())
        try:
            out = await client.tokenize(**args)
        except EngineError as exc:
            raise api_error_of(exc) from None
        return {"count": len(out.token_ids), "max_model_len": out.max_model_len,
                "tokens": out.token_ids, "token_strs": None}  # fmt: skip

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await read_json(request, settings.max_body_bytes)
        client = link.ready_client()
        tokens = R.parse_detokenize(body, link.model_info.vocab_size or 1 << 31)
        R.check_model(_model_field(body), served_names())
        try:
            out = await client.detokenize(tokens)
        except EngineError as exc:
            raise api_error_of(exc) from None
        return {"prompt": out.text}

    async def run_plan(request: Request, plan: R.GenerationPlan) -> Response:
        R.check_model(plan.model or None, served_names())
        client = link.ready_client()
        if app.state.in_flight >= settings.max_pending:
            raise APIError(
                429,
                f"{app.state.in_flight} requests in flight (the server's --max-pending); retry",
                headers={"retry-after": "1"},
            )
        reply = Reply(plan, model=plan.model or served_names()[0])
        gen = Generation(client, plan, reply.id)
        app.state.in_flight += 1
        handed_over = False
        try:
            await gen.start()
            if plan.stream:
                first = await _until_disconnect(request, _first_events(gen))
                handed_over = True
                return SSEResponse(_stream(reply, gen, first), on_close=_closer(app, gen))
            await _until_disconnect(request, _collect(reply, gen))
            return JSONResponse(reply.response())
        finally:
            if not handed_over:
                await gen.close()
                app.state.in_flight -= 1

    return app


def default_model_id(name: str) -> str:
    """A model id clients can type: the engine's display name without its "(format)" note,
    spaces as dashes ("SmolLM2-135M-Instruct (Q4_1 GGUF)" -> "SmolLM2-135M-Instruct")."""
    return name.split(" (", 1)[0].strip().replace(" ", "-") or "model"


def _model_field(body: Any) -> str | None:
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) else None


def _closer(app: FastAPI, gen: Generation) -> Callable[[], Awaitable[None]]:
    async def close() -> None:
        await gen.close()
        app.state.in_flight -= 1

    return close


async def _until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Run `work`, cancelling it when the client disconnects first (then 499-like: the
    response is never read, the caller's finally aborts the engine requests)."""
    task = asyncio.ensure_future(work)
    listener = asyncio.create_task(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise APIError(400, "the client disconnected", code="client_disconnected")
    return task.result()


async def _collect(reply: Reply, gen: Generation) -> None:
    async for index, msg in gen.events():
        reply.add(index, msg)


async def _first_events(gen: Generation) -> list[tuple[int, Any]]:
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


async def _stream(
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
        if isinstance(msg, P.Delta):
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
