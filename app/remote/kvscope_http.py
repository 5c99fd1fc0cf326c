"""A KVScope engine reached through its HTTP front-end (`kvscope serve`): the engine's welcome
and its telemetry stream, so a remote window needs one port and one key for the per-block view.

Wire format of GET /kvscope/telemetry (docs/PROTOCOL.md section 9): frames of a 4-byte
big-endian length, then one MessagePack `Telemetry` exactly as the engine published it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import httpx
import msgspec

from ipc import protocol as P

MAX_FRAME_BYTES = P.MAX_PUB_MESSAGE_BYTES
ROLES = ("prefill", "decode")  # the engines of a disaggregated deployment, in pipeline order


class RemoteError(RuntimeError):
    """The server answered, but not as a KVScope front-end does (or refused the key).
    `status`: the HTTP status when the server answered with an error status."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {api_key}"} if api_key else {}


def check_status(r: httpx.Response, what: str) -> None:
    if r.status_code == 401:
        raise RemoteError(f"{what}: the server refused the API key (401)", 401)
    if r.status_code == 404:
        raise RemoteError(f"{what}: not found (404): is this a KVScope server?", 404)
    if r.status_code >= 400:
        raise RemoteError(f"{what}: HTTP {r.status_code}: {_message(r)}", r.status_code)


def _message(r: httpx.Response) -> str:
    """An OpenAI-shaped error's message (what KVScope's front-end sends), else the text."""
    try:
        return str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return r.text[:200]


def _query(engine: str | None) -> str:
    """The `?engine=` of a disaggregated deployment's routes ("" for the deployment itself)."""
    if engine is None:
        return ""
    if engine not in ROLES:
        raise ValueError(f"engine must be one of {', '.join(ROLES)} or None, got {engine!r}")
    return f"?engine={engine}"


def _welcome_of(r: httpx.Response, path: str = "/kvscope/welcome") -> P.Welcome:
    check_status(r, "GET " + path)
    try:
        msg = P.decode_engine(r.content)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise RemoteError(f"GET {path}: not a KVScope answer ({exc})") from None
    if not isinstance(msg, P.Welcome):
        raise RemoteError(f"GET {path}: expected a welcome, got {type(msg).__name__}")
    return msg


async def afetch_welcome(http: httpx.AsyncClient, base_url: str, api_key: str | None,
                         timeout: float = 10.0, engine: str | None = None) -> P.Welcome:
    """`fetch_welcome` over an AsyncClient (httpx errors pass through); `engine` names one
    engine of a disaggregated deployment."""
    path = "/kvscope/welcome" + _query(engine)
    r = await http.get(base_url + path, headers=auth_headers(api_key), timeout=timeout)
    return _welcome_of(r, path)


@dataclass(slots=True)
class Deployment:
    """GET /kvscope/deployment: one engine, or a prefill and a decode engine."""

    disaggregated: bool
    engines: dict[str, str]  # role ("engine" when there is one) -> loading | ready | gone
    detail: dict[str, str] = field(default_factory=dict)  # role -> why it is not ready
    welcomes: dict[str, P.Welcome | None] = field(default_factory=dict)  # filled by discovery


async def afetch_deployment(http: httpx.AsyncClient, base_url: str, api_key: str | None,
                            timeout: float = 10.0) -> Deployment | None:
    """What the front-end fronts; None from an older front-end without the route (404)."""
    what = "GET /kvscope/deployment"
    r = await http.get(base_url + "/kvscope/deployment", headers=auth_headers(api_key),
                       timeout=timeout)
    if r.status_code == 404:
        return None
    check_status(r, what)
    try:
        body = r.json()
        engines = {str(k): str(v) for k, v in body["engines"].items()}
        detail = {str(k): str(v) for k, v in (body.get("detail") or {}).items()}
        return Deployment(disaggregated=bool(body["disaggregated"]), engines=engines,
                          detail=detail)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise RemoteError(f"{what}: not a KVScope answer ({exc!r})") from None


async def astream_telemetry(
    http: httpx.AsyncClient, base_url: str, api_key: str | None, engine: str | None = None
) -> AsyncIterator[P.Telemetry]:
    """`stream_telemetry` over an AsyncClient: snapshots until the server closes the stream
    (httpx errors pass through; cancel the consumer to stop early); `engine` names one engine
    of a disaggregated deployment."""
    path = "/kvscope/telemetry" + _query(engine)
    async with http.stream("GET", base_url + path, headers=auth_headers(api_key)) as r:
        if r.status_code >= 400:
            await r.aread()
        check_status(r, "GET " + path)
        reader = FrameReader()
        async for chunk in r.aiter_bytes():
            for msg in reader.feed(chunk):
                yield msg


def fetch_welcome(base_url: str, api_key: str | None, timeout: float = 10.0,
                  engine: str | None = None) -> P.Welcome:
    path = "/kvscope/welcome" + _query(engine)
    r = httpx.get(base_url + path, headers=auth_headers(api_key), timeout=timeout)
    return _welcome_of(r, path)


class FrameReader:
    """Splits the telemetry byte stream into Telemetry messages, whatever the chunking."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, chunk: bytes) -> list[P.Telemetry]:
        """The messages completed by `chunk`; RemoteError on a malformed frame."""
        buf = self._buf
        buf += chunk
        out: list[P.Telemetry] = []
        while len(buf) >= 4:
            size = int.from_bytes(buf[:4], "big")
            if size > MAX_FRAME_BYTES:
                raise RemoteError(f"telemetry frame of {size} bytes is over the limit")
            if len(buf) < 4 + size:
                break
            raw = bytes(buf[4 : 4 + size])
            del buf[: 4 + size]
            try:
                msg = P.decode_pub(raw)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise RemoteError(f"undecodable telemetry frame: {exc}") from None
            if isinstance(msg, P.Telemetry):
                out.append(msg)
        return out


def telemetry_frames(stream: Iterator[bytes]) -> Iterator[P.Telemetry]:
    """Split a byte stream into Telemetry messages; RemoteError on a malformed frame."""
    reader = FrameReader()
    for chunk in stream:
        yield from reader.feed(chunk)


def stream_telemetry(
    base_url: str, api_key: str | None, client: httpx.Client | None = None,
    engine: str | None = None,
) -> Iterator[P.Telemetry]:
    """Telemetry snapshots until the server closes the stream (the caller closes the iterator
    to stop early)."""
    own = client is None
    http = client or httpx.Client(timeout=httpx.Timeout(10.0, read=30.0))
    path = "/kvscope/telemetry" + _query(engine)
    try:
        with http.stream("GET", base_url + path, headers=auth_headers(api_key)) as r:
            if r.status_code >= 400:
                r.read()
            check_status(r, "GET " + path)
            yield from telemetry_frames(r.iter_bytes())
    finally:
        if own:
            http.close()
