"""The /kvscope/* routes of the HTTP front-end (docs/PROTOCOL.md section 9) in front of a
disaggregated deployment and of one engine, in-process: scripted engine clients stand in for the
two engines, so what each route relays is known exactly."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from app.api.server import EngineLink, create_app
from app.api.settings import ServerSettings
from app.remote.kvscope_http import FrameReader
from app.router.deployment import DisaggLink
from ipc import protocol as P
from tests.app.remote.fake_disagg import snapshot, welcome

KEY = "k" * 20


class ScriptedClient:
    """An engine client whose telemetry tap holds `snaps`; it reports itself gone once a tap
    has been read to the end, which ends the relayed stream."""

    def __init__(self, role: str, seqs: range) -> None:
        import numpy as np

        self.welcome = welcome(role, 32)
        self.model_info = self.welcome.model
        self.gone_reason: str | None = None
        self.snaps = [snapshot(s, 10.0 * s, {"role_" + role: 1.0}, np.zeros(32, np.uint8), [])
                      for s in seqs]  # fmt: skip
        self.taps: list[asyncio.Queue[bytes]] = []
        self.untapped = 0

    @property
    def state(self) -> str:
        return "gone" if self.taps and all(t.empty() for t in self.taps) else "ready"

    def tap_telemetry(self, maxsize: int = 16) -> asyncio.Queue[bytes]:
        tap: asyncio.Queue[bytes] = asyncio.Queue()
        for snap in self.snaps:
            tap.put_nowait(P.encode(snap))
        self.taps.append(tap)
        return tap

    def untap_telemetry(self, tap: asyncio.Queue[bytes]) -> None:
        self.untapped += 1


def _attach(link: EngineLink, client: ScriptedClient) -> None:
    link.client, link.status, link.detail = client, "ready", "serving"  # type: ignore[assignment]


def _disagg(decode_up: bool = True) -> tuple[DisaggLink, ScriptedClient, ScriptedClient]:
    link = DisaggLink()
    prefill, decode = ScriptedClient("prefill", range(1, 4)), ScriptedClient("decode", range(7, 9))
    _attach(link.prefill, prefill)
    if decode_up:
        _attach(link.decode, decode)
    else:
        link.decode.detail = "the model is loading"
    return link, prefill, decode


def _get(link, path: str, key: str | None = None, send: str | None = None) -> httpx.Response:
    """GET `path` from a front-end that wants `key`, sending `send` (default: the key)."""
    settings = ServerSettings(api_keys=[key] if key else [])
    app = create_app(settings, link)
    send = key if send is None else send

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            headers = {"authorization": f"Bearer {send}"} if send else {}
            return await http.get(path, headers=headers)

    return asyncio.run(asyncio.wait_for(go(), 60))  # a stream that never ends fails, not hangs


def _frames(r: httpx.Response) -> list[P.Telemetry]:
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/vnd.kvscope.msgpack"
    return FrameReader().feed(r.content)


def test_deployment_says_what_is_served_and_how_each_engine_is() -> None:
    link, _, _ = _disagg(decode_up=False)
    assert _get(link, "/kvscope/deployment").json() == {
        "disaggregated": True, "engines": {"prefill": "ready", "decode": "loading"},
        "detail": {"prefill": "serving", "decode": "the model is loading"}, "refused": None,
    }  # fmt: skip
    link, prefill, _ = _disagg()
    prefill.taps.append(asyncio.Queue())  # read to the end: the engine went away
    assert _get(link, "/kvscope/deployment").json()["engines"] == {
        "prefill": "gone", "decode": "ready"}
    one = EngineLink()
    _attach(one, ScriptedClient("", range(1, 2)))
    assert _get(one, "/kvscope/deployment").json() == {
        "disaggregated": False, "engines": {"engine": "ready"}, "detail": {"engine": "serving"}}


def test_welcome_and_telemetry_of_each_engine() -> None:
    link, prefill, decode = _disagg()
    for role, client in (("prefill", prefill), ("decode", decode)):
        r = _get(link, f"/kvscope/welcome?engine={role}")
        assert r.status_code == 200 and P.decode_engine(r.content) == client.welcome
    for role, client, seqs in (("prefill", prefill, [1, 2, 3]), ("decode", decode, [7, 8])):
        frames = _frames(_get(link, f"/kvscope/telemetry?engine={role}"))
        assert [f.seq for f in frames] == seqs and frames == client.snaps
        assert client.untapped == 1  # the tap is given back when the stream ends
    # without the parameter, as before: the deployment's own (the decode engine's), or the
    # prefill engine's while the decode engine is down; its stream ends with that engine
    link, _, decode = _disagg()
    r = _get(link, "/kvscope/welcome")
    assert r.status_code == 200 and P.decode_engine(r.content) == decode.welcome
    # (the prefill engine stays up: a relay that watched the pair instead would never end)
    assert _frames(_get(link, "/kvscope/telemetry")) == decode.snaps
    link, prefill, _ = _disagg(decode_up=False)
    r = _get(link, "/kvscope/welcome")
    assert r.status_code == 200 and P.decode_engine(r.content) == prefill.welcome
    assert _frames(_get(link, "/kvscope/telemetry")) == prefill.snaps


@pytest.mark.parametrize("route", ["welcome", "telemetry"])
def test_a_bad_or_missing_engine_is_said(route: str) -> None:
    link, _, _ = _disagg(decode_up=False)
    r = _get(link, f"/kvscope/{route}?engine=both")
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "engine"
    assert error["message"] == "engine must be one of prefill, decode, got 'both'"
    r = _get(link, f"/kvscope/{route}?engine=decode")
    assert r.status_code == 503
    assert r.json()["error"]["message"] == "the decode engine is not ready: the model is loading"
    assert r.json()["error"]["code"] == "engine_unavailable"
    one = EngineLink()
    _attach(one, ScriptedClient("", range(1, 2)))
    r = _get(one, f"/kvscope/{route}?engine=prefill")
    assert r.status_code == 400 and r.json()["error"]["param"] == "engine"
    assert "needs a disaggregated deployment" in r.json()["error"]["message"]


def test_the_routes_need_the_key_like_the_others() -> None:
    link, _, _ = _disagg()
    for path in ("/kvscope/deployment", "/kvscope/welcome?engine=prefill",
                 "/kvscope/telemetry?engine=decode"):
        assert _get(link, path, key=KEY, send="").status_code == 401, path
        assert _get(link, path, key=KEY, send="x" * 20).status_code == 401, path
    assert _get(link, "/kvscope/deployment", key=KEY).status_code == 200
