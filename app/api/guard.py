"""What every request passes before a route: the Host header (on loopback binds it must name a
loopback host: DNS rebinding against local LLM servers is a known attack), the API key
(everything but /health, /metrics and /version), and a bounded JSON body."""

from __future__ import annotations

import hashlib
import ipaddress
import json
import secrets
from typing import Any

from fastapi import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from app.api.anthropic_messages import error_body as anthropic_error
from app.api.errors import APIError
from app.api.settings import LOOPBACK_HOSTS, ServerSettings

OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})
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
            # Anthropic's SDK reads errors in its own shape (Claude Code shows them as such)
            body = anthropic_error(error) if _is_messages(scope["path"]) else error.body()
            await _send_json(send, error.status, body, error.headers)
            return
        await self.app(scope, receive, send)

    def _check(self, scope: Scope, headers: dict[str, str]) -> APIError | None:
        if self.settings.loopback:
            host = _host_name(headers.get("host", ""))
            if host not in self.allowed and not _is_loopback_ip(host):
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
                    "missing or wrong API key: send 'Authorization: Bearer <key>' "
                    "(or 'x-api-key: <key>', as Anthropic's clients do)",
                    code="invalid_api_key",
                    headers={"www-authenticate": "Bearer"},
                )
        return None


def _is_messages(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def _is_loopback_ip(host: str) -> bool:
    """127.0.0.0/8 and ::1 written as addresses (never a name that could resolve elsewhere)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


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
