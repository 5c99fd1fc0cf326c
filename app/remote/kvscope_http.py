"""A KVScope engine reached through its HTTP front-end (`kvscope serve`): the engine's welcome
and its telemetry stream, so a remote window needs one port and one key for the per-block view.

Wire format of GET /kvscope/telemetry (docs/PROTOCOL.md section 9): frames of a 4-byte
big-endian length, then one MessagePack `Telemetry` exactly as the engine published it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import httpx
import msgspec

from ipc import protocol as P

MAX_FRAME_BYTES = P.MAX_PUB_MESSAGE_BYTES


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
        raise RemoteError(f"{what}: HTTP {r.status_code}: {r.text[:200]}", r.status_code)


def _welcome_of(r: httpx.Response) -> P.Welcome:
    check_status(r, "GET /kvscope/welcome")
    try:
        msg = P.decode_engine(r.content)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise RemoteError(f"GET /kvscope/welcome: not a KVScope answer ({exc})") from None
    if not isinstance(msg, P.Welcome):
        raise RemoteError(f"GET /kvscope/welcome: expected a welcome, got {type(msg).__name__}")
    return msg


async def afetch_welcome(http: httpx.AsyncClient, base_url: str, api_key: str | None,
                         timeout: float = 10.0) -> P.Welcome:
    """`fetch_welcome` over an AsyncClient (httpx errors pass through)."""
    r = await http.get(base_url + "/kvscope/welcome", headers=auth_headers(api_key),
                       timeout=timeout)
    return _welcome_of(r)


async def astream_telemetry(
    http: httpx.AsyncClient, base_url: str, api_key: str | None
) -> AsyncIterator[P.Telemetry]:
    """`stream_telemetry` over an AsyncClient: snapshots until the server closes the stream
    (httpx errors pass through; cancel the consumer to stop early)."""
    async with http.stream(
        "GET", base_url + "/kvscope/telemetry", headers=auth_headers(api_key)
    ) as r:
        if r.status_code >= 400:
            await r.aread()
        check_status(r, "GET /kvscope/telemetry")
        reader = FrameReader()
        async for chunk in r.aiter_bytes():
            for msg in reader.feed(chunk):
                yield msg


def fetch_welcome(base_url: str, api_key: str | None, timeout: float = 10.0) -> P.Welcome:
    r = httpx.get(base_url + "/kvscope/welcome", headers=auth_headers(api_key), timeout=timeout)
    return _welcome_of(r)


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
    base_url: str, api_key: str | None, client: httpx.Client | None = None
) -> Iterator[P.Telemetry]:
    """Telemetry snapshots until the server closes the stream (the caller closes the iterator
    to stop early)."""
    own = client is None
    http = client or httpx.Client(timeout=httpx.Timeout(10.0, read=30.0))
    try:
        with http.stream(
            "GET", base_url + "/kvscope/telemetry", headers=auth_headers(api_key)
        ) as r:
            if r.status_code >= 400:
                r.read()
            check_status(r, "GET /kvscope/telemetry")
            yield from telemetry_frames(r.iter_bytes())
    finally:
        if own:
            http.close()
