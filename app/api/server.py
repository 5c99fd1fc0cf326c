"""The ASGI app of the OpenAI-compatible API: security first (guard.py), then bounded work,
then routes. At most `max_pending` calls are in flight (429 with retry-after beyond), and every
engine request of a call that ends early (client gone, error) is aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib import metadata
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.api import agent_routes, agent_runs
from app.api import requests as R
from app.api.agent_runs import APIEncoder, ChoiceRun
from app.api.errors import APIError, error_body
from app.api.generation import Generation, api_error_of
from app.api.guard import GuardMiddleware, read_json
from app.api.metrics import render as render_metrics
from app.api.responses import Reply
from app.api.settings import ServerSettings
from app.api.streaming import SSEResponse, first_events, stream_chunks, wait_disconnect
from app.api.tools.request import apply_model
from ipc import protocol as P
from ipc.async_client import AsyncEngineClient
from ipc.client import EngineError

log = logging.getLogger(__name__)

TELEMETRY_MEDIA_TYPE = "application/vnd.kvscope.msgpack"  # docs/PROTOCOL.md section 9
ENGINE_ROLES = ("prefill", "decode")  # the engines of a disaggregated deployment


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
        if self.client is not None:  # its streams end now, not after the heartbeat silence
            self.client.lost(why)


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
            allow_headers=["authorization", "content-type", "x-api-key", "anthropic-version"],
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
        apply_model(plan, link.model_info, settings.tool_call_parser)
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

    def relay_client(engine: str | None) -> Any:
        """The client whose welcome and telemetry a /kvscope/* route relays: the deployment's
        (no `engine`: what old windows ask for), or one engine of a disaggregated one."""
        if engine is None:
            client = link.ready_client()
            engines = engines_of(link)
            if engines is None:
                return client
            # the pair's own answer is its decode engine's (the prefill one's while decode is
            # down): relayed from that engine, so that its stream ends when it goes away
            return next((one.client for one in (engines["decode"], engines["prefill"])
                         if engine_status(one) == "ready"), client)  # fmt: skip
        if engine not in ENGINE_ROLES:
            raise APIError(400, f"engine must be one of {', '.join(ENGINE_ROLES)}, got {engine!r}",
                           param="engine")  # fmt: skip
        engines = engines_of(link)
        if engines is None:
            raise APIError(400, f"engine={engine} needs a disaggregated deployment (kvscope serve "
                           "--disaggregated); this server fronts one engine: leave engine out",
                           param="engine")  # fmt: skip
        one = engines[engine]
        if engine_status(one) != "ready":
            raise APIError(503, f"the {engine} engine is not ready: {one.detail}",
                           code="engine_unavailable")  # fmt: skip
        return one.ready_client()

    @app.get("/kvscope/deployment")
    async def kvscope_deployment() -> dict[str, Any]:
        """One engine or a prefill/decode pair, and how each engine is doing."""
        engines = engines_of(link)
        if engines is None:
            return {"disaggregated": False, "engines": {"engine": engine_status(link)},
                    "detail": {"engine": link.detail}}  # fmt: skip
        return {
            "disaggregated": True,
            "engines": {role: engine_status(one) for role, one in engines.items()},
            "detail": {role: one.detail for role, one in engines.items()},
            "refused": getattr(link, "refused", None),
        }

    @app.get("/kvscope/welcome")
    async def kvscope_welcome(engine: str | None = None) -> Response:
        """The engine's hello answer (model, live config), for a window attached over HTTP."""
        client = relay_client(engine)
        assert client.welcome is not None
        return Response(P.encode(client.welcome), media_type=TELEMETRY_MEDIA_TYPE)

    @app.get("/kvscope/telemetry")
    async def kvscope_telemetry(engine: str | None = None) -> Response:
        """Every telemetry snapshot, as the engine's PUB sends it: frames of a 4-byte big-endian
        length and one MessagePack Telemetry. A slow reader loses the oldest snapshots."""
        client = relay_client(engine)
        tap = client.tap_telemetry()

        async def frames() -> AsyncIterator[bytes]:
            while client.state == "ready":
                try:
                    raw = await asyncio.wait_for(tap.get(), timeout=5.0)
                except TimeoutError:
                    continue
                yield len(raw).to_bytes(4, "big") + raw

        async def close() -> None:
            client.untap_telemetry(tap)

        return SSEResponse(frames(), on_close=close, media_type=TELEMETRY_MEDIA_TYPE)

    async def run_plan(
        request: Request,
        plan: R.GenerationPlan,
        api: Callable[[str], APIEncoder] | None = None,
    ) -> Response:
        """One generation, answered as chat/completions, or by `api(model)`'s encoder (the
        Responses and Messages APIs: one chat choice read by agent_runs.ChoiceRun)."""
        R.check_model(plan.model or None, served_names())
        client = link.ready_client()
        if app.state.in_flight >= settings.max_pending:
            raise APIError(
                429,
                f"{app.state.in_flight} requests in flight (the server's --max-pending); retry",
                headers={"retry-after": "1"},
            )
        model = plan.model or served_names()[0]
        encoder = None if api is None else api(model)
        reply = Reply(plan, model=model)
        gen = Generation(client, plan, reply.id if encoder is None else encoder.id)
        app.state.in_flight += 1
        handed_over = False
        try:
            run = None if encoder is None else ChoiceRun(agent_runs.default_reader(plan))
            await gen.start()
            if run is not None and encoder is not None:
                if plan.stream:
                    first = await _until_disconnect(request, first_events(gen))
                    handed_over = True
                    return SSEResponse(agent_runs.stream(gen, run, encoder, first),
                                       on_close=_closer(app, gen))  # fmt: skip
                result = await _until_disconnect(request, agent_runs.collect(gen, run))
                return JSONResponse(encoder.body(result))
            if plan.stream:
                first = await _until_disconnect(request, first_events(gen))
                handed_over = True
                return SSEResponse(stream_chunks(reply, gen, first), on_close=_closer(app, gen))
            await _until_disconnect(request, _collect(reply, gen))
            return JSONResponse(reply.response())
        finally:
            if not handed_over:
                await gen.close()
                app.state.in_flight -= 1

    # the Responses and Messages APIs (app/api/agent_routes.py)
    agent_routes.register(app, agent_routes.Serving(link, settings, limits, served_names,
                                                    run_plan))  # fmt: skip
    return app


def default_model_id(name: str) -> str:
    """A model id clients can type: the engine's display name without its "(format)" note,
    spaces as dashes ("SmolLM2-135M-Instruct (Q4_1 GGUF)" -> "SmolLM2-135M-Instruct")."""
    return name.split(" (", 1)[0].strip().replace(" ", "-") or "model"


def engines_of(link: Any) -> dict[str, EngineLink] | None:
    """A disaggregated deployment's engines by role (app/router/deployment.py DisaggLink has
    one EngineLink each); None for a single engine."""
    engines = {role: getattr(link, role, None) for role in ENGINE_ROLES}
    if all(isinstance(one, EngineLink) for one in engines.values()):
        return engines  # type: ignore[return-value]
    return None


def engine_status(link: EngineLink) -> str:
    """loading | ready | gone, noticing a client that went away since the link last looked."""
    client = link.client
    if link.status == "ready" and (client is None or client.state != "ready"):
        return "gone"
    return link.status


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
    listener = asyncio.create_task(wait_disconnect(request.receive))
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
