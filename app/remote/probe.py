"""What is behind a URL: an OpenAI-compatible server (GET /v1/models), of which kind (the metric
prefixes on /metrics, else /v1/models' `owned_by`), with which metrics, and for a KVScope
front-end the engine's welcome (per-block telemetry over HTTP). Async (httpx.AsyncClient): the
window's worker thread runs it on its event loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

from app.remote.kvscope_http import (
    ROLES,
    Deployment,
    RemoteError,
    afetch_deployment,
    afetch_welcome,
    auth_headers,
)
from app.remote.metrics import CANONICAL, MAX_METRICS_BYTES, MetricsError, Scrape, detect_kind
from app.remote.metrics import parse_scrape as _parse
from app.remote.openai_client import alist_models, describe
from ipc import protocol as P

KIND_NAMES = {
    "vllm": "vLLM", "sglang": "SGLang", "llamacpp": "llama.cpp server", "kvscope": "KVScope",
    "unknown": "OpenAI-compatible server",
}  # fmt: skip
# what each canonical metric is called in the window
METRIC_LABELS = {
    "running": "running requests", "waiting": "waiting requests", "kv_usage": "KV cache usage",
    "prefix_queries": "prefix-cache queries", "prefix_hits": "prefix-cache hits",
    "prompt_tokens": "prompt tokens", "generation_tokens": "generation tokens",
    "preemptions": "preemptions", "ttft": "TTFT", "itl": "inter-token latency",
}  # fmt: skip
assert set(METRIC_LABELS) == set(CANONICAL)


def normalize_url(url: str) -> str:
    """'host:8000/v1/' -> 'http://host:8000'; ValueError naming what is wrong."""
    raw = (url or "").strip()
    if not raw:
        raise ValueError("server URL must not be empty (e.g. http://127.0.0.1:8000)")
    if "://" not in raw:
        raw = "http://" + raw
    parts = urlsplit(raw)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"server URL must start with http:// or https://, got {url!r}")
    if not parts.hostname:
        raise ValueError(f"server URL needs a host, got {url!r}")
    try:
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        raise ValueError(f"server URL has a bad port: {url!r}") from None
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):  # the base URL OpenAI clients take
        path = path[:-3]
    return f"{parts.scheme}://{parts.netloc}{path}"


def is_http_url(endpoint: str | None) -> bool:
    return bool(endpoint) and endpoint.split("://", 1)[0] in ("http", "https")


@dataclass(slots=True)
class ServerInfo:
    url: str
    kind: str  # one of KIND_NAMES
    models: list[dict]
    metrics_note: str = ""  # why there are no metrics ("" when /metrics answered)
    welcome: P.Welcome | None = None  # a KVScope front-end: the engine behind it
    first_scrape: Scrape | None = None
    missing: list[str] = field(default_factory=list)  # canonical metrics not exported
    deployment: Deployment | None = None  # a KVScope front-end: one engine or a pair

    @property
    def model(self) -> str:
        return str(self.models[0]["id"]) if self.models else ""

    @property
    def name(self) -> str:
        return KIND_NAMES.get(self.kind, self.kind)

    @property
    def per_block(self) -> bool:
        return self.welcome is not None

    @property
    def disaggregated(self) -> bool:
        """A KVScope prefill/decode pair: the window follows each engine's telemetry."""
        return self.per_block and self.deployment is not None and self.deployment.disaggregated


async def fetch_metrics_text(http: httpx.AsyncClient, base_url: str, api_key: str | None,
                             timeout: float, limit: int = MAX_METRICS_BYTES) -> str:
    """GET /metrics as text, read no further than `limit` bytes. RemoteError when the server
    does not answer or answers with an HTTP error; MetricsError when the answer is too big or not
    text."""
    try:
        async with http.stream("GET", base_url + "/metrics", headers=auth_headers(api_key),
                               timeout=timeout) as r:
            if r.status_code >= 400:
                raise RemoteError(f"GET /metrics answered HTTP {r.status_code}", r.status_code)
            body = bytearray()
            async for chunk in r.aiter_bytes():
                body += chunk
                if len(body) > limit:
                    raise MetricsError(f"/metrics is over the {limit >> 20} MiB limit")
    except httpx.TimeoutException:
        raise RemoteError(f"GET /metrics did not answer within {timeout:g} s") from None
    except httpx.HTTPError as exc:
        raise RemoteError(f"cannot reach {base_url}: {describe(exc)}") from None
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        raise MetricsError("/metrics is not text (not UTF-8)") from None


def parse_scrape(text: str, now: float, kind: str | None) -> Scrape:
    """app.remote.metrics.parse_scrape, with the kind known from discovery ("unknown": none)."""
    return _parse(text, now, None if kind in (None, "unknown") else kind)


async def discover(http: httpx.AsyncClient, base_url: str, api_key: str | None, *,
                   timeout: float = 10.0, metrics_timeout: float = 10.0,
                   clock=time.monotonic) -> ServerInfo:
    """Who is behind `base_url`. RemoteError when it is unreachable, refuses the key or is not
    OpenAI-compatible; a /metrics that is missing, slow or unreadable only leaves the metrics
    out (`metrics_note` says why)."""
    models = await alist_models(http, base_url, api_key, timeout=timeout)
    owned_by = next((str(m.get("owned_by", "")) for m in models if m.get("owned_by")), None)
    info = ServerInfo(url=base_url, kind=detect_kind("", owned_by), models=models,
                      missing=list(CANONICAL))
    try:
        text = await fetch_metrics_text(http, base_url, api_key, metrics_timeout)
        kind = detect_kind(text, owned_by)
        scrape = parse_scrape(text, clock(), kind)
    except (RemoteError, MetricsError) as exc:
        info.metrics_note = str(exc)
    else:
        info.kind, info.first_scrape, info.missing = kind, scrape, scrape.missing
        if kind == "unknown":
            info.metrics_note = "/metrics has none of the metric names this window knows"
    if info.kind == "kvscope":
        try:
            info.welcome = await afetch_welcome(http, base_url, api_key, timeout=timeout)
        except (RemoteError, httpx.HTTPError) as exc:
            # an older front-end without /kvscope/*: its /metrics still works
            info.metrics_note = info.metrics_note or f"no per-block telemetry ({exc})"
        else:
            info.deployment = await discover_deployment(http, base_url, api_key, timeout)
    return info


async def discover_deployment(http: httpx.AsyncClient, base_url: str, api_key: str | None,
                              timeout: float = 10.0) -> Deployment | None:
    """A KVScope front-end's deployment, with each engine's welcome when it is disaggregated
    (None for an engine that is not up now). None from an older front-end."""
    try:
        deployment = await afetch_deployment(http, base_url, api_key, timeout)
    except (RemoteError, httpx.HTTPError):
        return None
    if deployment is not None and deployment.disaggregated:
        for role in ROLES:
            try:
                welcome = await afetch_welcome(http, base_url, api_key, timeout, engine=role)
            except (RemoteError, httpx.HTTPError):
                welcome = None
            deployment.welcomes[role] = welcome
    return deployment
