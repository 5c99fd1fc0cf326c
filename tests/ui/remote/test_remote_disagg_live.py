"""A real `kvscope serve --disaggregated` (tiny model, a prefill and a decode engine) through its
/kvscope/* routes, and the window attached to it while it serves chats. One deployment for the
module: spawning two engines is the slow part.

References: the roles each engine reports itself, the chats' own usage (the prefill engine
samples one token per chat, the decode engine the rest), the prefill engine's count of blocks
sent against the decode engine's count of blocks received, and the transfer numbers recomputed
from the snapshots the window was given."""

from __future__ import annotations

import httpx
import pytest

from app.conversations import ConversationStore
from app.remote.kvscope_http import fetch_welcome, stream_telemetry
from app.settings import open_settings
from ipc import protocol as P
from ipc.client import TelemetrySubscriber
from tests.app.api.helpers import API_KEY, ServeProc
from tests.ui.conftest import send_chat
from ui.telemetry import Frame
from ui.window.main_window import EngineSource, MainWindow, wait_until

pytestmark = pytest.mark.slow
AUTH = {"authorization": f"Bearer {API_KEY}"}
BLOCKS = 96
MAX_TOKENS = 64
PROMPTS = ["Explain how a paged KV cache stores attention keys and values, in detail.",
           "Why does prefix caching make repeated system prompts cheaper to serve?",
           "Describe prefill and decode disaggregation and the transfer of KV blocks."]


@pytest.fixture(scope="module")
def deployment(tiny_dir):
    proc = ServeProc([
        "--port", "0", "--model", str(tiny_dir), "--dtype", "float32", "--decode-weights",
        "dense", "--api-key", API_KEY, "--disaggregated", "--disagg-cores", "2",
        "--engine-args", f"--num-kv-blocks {BLOCKS} --telemetry-hz 50",
    ])  # fmt: skip
    try:
        proc.wait_engines()
        yield proc
    finally:
        proc.stop()


def test_each_engine_is_relayed_on_its_own(deployment):
    url = deployment.url
    dep = httpx.get(url + "/kvscope/deployment", headers=AUTH, timeout=30).json()
    assert dep["disaggregated"] is True
    assert dep["engines"] == {"prefill": "ready", "decode": "ready"}
    welcomes = {role: fetch_welcome(url, API_KEY, engine=role) for role in ("prefill", "decode")}
    assert {r: w.model.role for r, w in welcomes.items()} == {"prefill": "prefill",
                                                               "decode": "decode"}
    assert welcomes["prefill"].model.num_blocks == welcomes["decode"].model.num_blocks == BLOCKS
    assert welcomes["prefill"].pub_endpoint != welcomes["decode"].pub_endpoint  # two engines
    assert fetch_welcome(url, API_KEY).model.role == "decode"  # no parameter: as before
    for role, welcome in welcomes.items():  # each stream is that engine's own PUB, relayed
        assert _relayed_snapshot_is_published(url, role, welcome.pub_endpoint), role
    r = httpx.get(url + "/kvscope/telemetry?engine=router", headers=AUTH, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "engine"


def _relayed_snapshot_is_published(url: str, role: str, pub_endpoint: str) -> bool:
    """A snapshot relayed by GET /kvscope/telemetry?engine=ROLE is, field for field, one that
    engine published on its own ZeroMQ PUB socket."""
    with TelemetrySubscriber(pub_endpoint) as sub:
        snaps = stream_telemetry(url, API_KEY, engine=role)
        published = {}
        try:
            for snap in snaps:
                while (z := sub.recv(timeout=5.0)) is not None:
                    if isinstance(z, P.Telemetry):
                        published[z.seq] = z
                        if z.seq >= snap.seq:
                            break
                if snap.seq in published:
                    return snap == published[snap.seq]
        finally:
            snaps.close()
    return False


def test_the_window_follows_both_engines_through_chats(deployment, qapp, tmp_path, qtbot):
    d = tmp_path / "data"
    win = MainWindow(open_settings(d), ConversationStore(d / "conversations"),
                     EngineSource(connect=deployment.url, api_key=API_KEY), data_dir=d)
    win.resize(1500, 950)
    win.show()
    seen: dict[str, list[Frame]] = {"prefill": [], "decode": []}
    try:
        win.start_engine()
        win.link.role_frames.connect(lambda by_role: [seen[r].extend(f) for r, f in
                                                      by_role.items()])  # fmt: skip
        assert wait_until(lambda: win.state in ("ready", "busy", "disconnected"), 60, qapp)
        assert win.state in ("ready", "busy"), win.last_error
        view = win.remote.disagg
        assert win.kv_stack.currentWidget() is view.panel
        replies = []
        for text in PROMPTS:
            send_chat(win, text, MAX_TOKENS)
            conv = win.chat.current
            qtbot.waitUntil(lambda c=conv: not win.chat.busy(c.id), timeout=180_000)
            reply = conv.messages[-1]
            assert not reply.interrupted and reply.content, reply.stats
            replies.append(reply.stats)
        # the last chat's request, under the id the front-end gave it, is shown in both pools
        # (found in the decode engine's snapshots: 64 tokens outlive several of them)
        alias = win.remote.aliases[win.chat.last_request[conv.id]]
        qtbot.waitUntil(lambda: all((m.highlight_rid or "").startswith(alias)
                                    for m in view.panel.maps.values()), timeout=30_000)
        handed = [s for s in replies if s["completion_tokens"] >= 2]  # first token not EOS
        assert handed, replies

        def settled() -> bool:
            p, dc = view.histories["prefill"].latest, view.histories["decode"].latest
            # each engine's counters as of the end of the chats (an idle engine publishes once
            # a second): every chat prefilled, every hand-over pulled, every block sent arrived,
            # every lease ended (the prefill engine ends one when its pull arrives, so the decode
            # engine's count of pulls can be published before the prefill engine's lease count)
            return (p is not None and dc is not None
                    and p.counters.get("generation_tokens_total") == len(PROMPTS)
                    and p.counters.get("kv_transfer_leases_active") == 0
                    and dc.counters.get("generation_tokens_total")
                    == sum(s["completion_tokens"] - 1 for s in handed)
                    and dc.counters.get("num_requests_running") == 0
                    and dc.counters.get("num_requests_waiting") == 0
                    and dc.counters.get("kv_transfer_pulls", 0)
                    + dc.counters.get("kv_transfer_releases", 0) == len(handed)
                    and p.counters.get("kv_transfer_blocks_sent")
                    == dc.counters.get("kv_transfer_blocks_received"))
        qtbot.waitUntil(settled, timeout=60_000)
        win.redraw_now()
        win.grab().save(str(tmp_path / "disagg_window.png"))
    finally:
        if win.link is not None:
            win.link.stop()
        qapp.processEvents()  # what the link emitted reaches the view and `seen` alike
        win.redraw_now()
        strip = {k: v.text() for k, v in win.remote.disagg.panel.strip.values.items()}
        titles = dict(win.remote.disagg.charts.titles)
        headers = {r: p.header.text() for r, p in win.remote.disagg.panel.pools.items()}
        rates = win.remote.disagg.transfer.rates
        win.shutdown()
        win.close()

    p, dc = seen["prefill"][-1].counters, seen["decode"][-1].counters
    # one token per chat on the prefill engine, the rest of each handed-over reply on decode
    assert p["generation_tokens_total"] == len(PROMPTS)
    assert dc["generation_tokens_total"] == sum(s["completion_tokens"] - 1 for s in handed)
    # the blocks the prefill engine sent are the blocks the decode engine received
    assert p["kv_transfer_blocks_sent"] == dc["kv_transfer_blocks_received"] > 0
    assert strip["pulls"] == f"{dc['kv_transfer_pulls']:,.0f}"
    assert strip["failures"].startswith(f"{dc['kv_transfer_pull_failures']:,.0f} · ")
    assert strip["pending"] == "0" and strip["leases"].startswith("0 · ")
    # mean time of one pull since start, and the rate over the window, from the snapshots
    assert rates.pull_ms_total == pytest.approx(
        dc["kv_transfer_pull_seconds"] / dc["kv_transfer_pulls"] * 1e3)
    last = seen["decode"][-1]
    first = max((f for f in seen["decode"] if f.time <= last.time - 10.0),
                key=lambda f: f.time, default=seen["decode"][0])
    got = last.counters["kv_transfer_blocks_received"] - first.counters[
        "kv_transfer_blocks_received"]
    assert rates.blocks_per_s == pytest.approx(got / (last.time - first.time))
    for role in ("prefill", "decode"):
        assert f"pool {BLOCKS} blocks × 16 tokens" in headers[role]
        assert "down" not in headers[role]
    assert titles["decode.req"] == "decode · requests: running 0 · waiting 0"
