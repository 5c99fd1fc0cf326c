"""A KVScope engine reached through its HTTP front-end (`kvscope serve`): the engine's welcome
and its telemetry stream, so a remote window needs one port and one key for the per-block view.

Wire format of GET /kvscope/telemetry (docs/PROTOCOL.md section 9): frames of a 4-byte
big-endian length, then one MessagePack `Telemetry` exactly as the engine published it.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import msgspec

from ipc import protocol as P

MAX_FRAME_BYTES = P.MAX_PUB_MESSAGE_BYTES


class RemoteError(RuntimeError):
    """The server answered, but not as a KVScope front-end does (or refused the key)."""


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {api_key}"} if api_key else {}


def check_status(r: httpx.Response, what: str) -> None:
    if r.status_code == 401:
        raise RemoteError(f"{what}: the server refused the API key (401)")
    if r.status_code == 404:
        raise RemoteError(f"{what}: not found (404): is this a KVScope server?")
    if r.status_code >= 400:
        raise RemoteError(f"{what}: HTTP {r.status_code}: {r.text[:200]}")


def fetch_welcome(base_url: str, api_key: str | None, timeout: float = 10.0) -> P.Welcome:
    r = httpx.get(base_url + "/kvscope/welcome", headers=auth_headers(api_key), timeout=timeout)
    check_status(r, "GET /kvscope/welcome")
    try:
        msg = P.decode_engine(r.content)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise RemoteError(f"GET /kvscope/welcome: not a KVScope answer ({exc})") from None
    if not isinstance(msg, P.Welcome):
        raise RemoteError(f"GET /kvscope/welcome: expected a welcome, got {type(msg).__name__}")
    return msg


def telemetry_frames(stream: Iterator[bytes]) -> Iterator[P.Telemetry]:
    """Split a byte stream into Telemetry messages; RemoteError on a malformed frame."""
    buf = bytearray()
    for chunk in stream:
        buf += chunk
        while len(buf) >= 4:
            size = int.from_bytes(buf[:4], "big")
            if size > MAX_FRAME_BYTES:
                raise RemoteError(f"telemetry frame of {size} bytes is over the limit")
            if len(buf) < 4 + size:
                break
            raw, buf = bytes(buf[4 : 4 + size]), buf[4 + size :]
            try:
                msg = P.decode_pub(raw)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise RemoteError(f"undecodable telemetry frame: {exc}") from None
            if isinstance(msg, P.Telemetry):
                yield msg


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
