"""The window attached over HTTP to a real `kvscope serve` (the session's `server` fixture: tiny
model, API key): chats stream through /v1/chat/completions, and the block map and charts are fed
from GET /kvscope/telemetry. Checked against the ZeroMQ attachment: a subscriber on the engine's
own PUB socket sees the very snapshots the window draws, and a History fed with them holds the
window's chart series exactly."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from app.conversations import ConversationStore
from app.remote.kvscope_http import fetch_welcome
from app.settings import open_settings
from ipc import protocol as P
from ipc.client import TelemetrySubscriber
from tests.app.api.helpers import API_KEY, MODEL, ServeProc
from ui.telemetry import Frame, History
from ui.window.main_window import EngineSource, MainWindow, wait_until

pytestmark = pytest.mark.slow


class ZmqFrames:
    """Every snapshot the engine publishes on ZeroMQ, by engine time (its own thread)."""

    def __init__(self, pub_endpoint: str) -> None:
        self.by_time: dict[float, Frame] = {}
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(pub_endpoint,), daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    def _run(self, endpoint: str) -> None:
        with TelemetrySubscriber(endpoint) as sub:
            self._ready.set()
            while not self._stop.is_set():
                msg = sub.recv(timeout=0.1)
                if isinstance(msg, P.Telemetry):
                    self.by_time[msg.time] = Frame.from_wire(msg)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def _window(tmp_path, url: str, key: str | None) -> MainWindow:
    d = tmp_path / "data"
    w = MainWindow(open_settings(d), ConversationStore(d / "conversations"),
                   EngineSource(connect=url, api_key=key), data_dir=d)
    w.resize(1400, 900)
    w.show()
    return w


def test_chat_block_map_and_charts_match_the_zeromq_attachment(server, sdk, qapp, tmp_path,
                                                                 qtbot):
    welcome = fetch_welcome(server.url, API_KEY)
    zmq = ZmqFrames(welcome.pub_endpoint)  # subscribed before the window sees anything
    win = _window(tmp_path, server.url, API_KEY)
    seen: list[Frame] = []
    try:
        win.start_engine()
        win.link.frames.connect(seen.extend)  # queued: nothing can have been emitted yet
        assert wait_until(lambda: win.state in ("ready", "busy", "disconnected"), 60, qapp)
        assert win.state in ("ready", "busy"), win.last_error
        # the full per-block view, not the aggregate one
        assert win.kv_stack.currentWidget() is win.kv_tabs
        assert win.chart_stack.currentWidget() is win.charts
        assert f"KVScope at {server.url}" in win.model_label.text()
        assert f"{welcome.model.num_blocks:,} blocks" in win.kv_label.text()
        assert not win.controls.isEnabled() and "engine protocol" in win.controls.toolTip()

        win.chat.temperature.setValue(0.0)
        win.chat.max_tokens.setValue(48)
        win.chat.new_conversation()
        win.chat.input.setPlainText("Tell me about paged attention.")
        rid = win.chat.send_current()
        conv = win.chat.current
        reply = conv.messages[-1]
        qtbot.waitUntil(lambda: not win.chat.busy(conv.id), timeout=120_000)
        assert not reply.interrupted, reply.stats
        # the same reply as an OpenAI client gets for the same conversation
        want = sdk.chat.completions.create(model=MODEL, messages=conv.to_prompt()[:-1],
                                           max_tokens=48, temperature=0)
        assert reply.content == want.choices[0].message.content
        line = win.chat._view_for(reply).stats.text()
        assert line.startswith("TTFT ") and " tok/s · prompt " in line
        assert f"/ generated {want.usage.completion_tokens}" in line and "/ cached " in line
        # the conversation's request is found in the block map under the engine's own id
        alias = win._chat_aliases[rid]
        qtbot.waitUntil(lambda: (win.block_map.highlight_rid or "").startswith(alias),
                        timeout=30_000)
        assert win.block_map.highlight_rid in win.history.last_tables

        qtbot.wait(1500)  # a few idle snapshots as well
    finally:
        win.shutdown()
        win.close()
        zmq.stop()

    # every frame the window drew is one the engine published on ZeroMQ, equal field by field
    assert len(seen) >= 5
    missing = [f.time for f in seen if f.time not in zmq.by_time]
    assert not missing, f"{len(missing)} of {len(seen)} HTTP frames never seen on ZeroMQ"
    busy = 0
    for f in seen:
        z = zmq.by_time[f.time]
        for name in ("state", "ref_count", "filled", "short_hash", "parent"):
            np.testing.assert_array_equal(getattr(f, name), getattr(z, name), err_msg=name)
        assert f.counters == z.counters and f.config == z.config
        assert f.requests == z.requests and f.token_events == z.token_events
        busy += any(r.block_table for r in f.requests)
    assert busy > 0  # the comparison covered blocks in use, not only an idle pool
    # the window's own chat, as the engine saw it: a request from the HTTP front-end
    ours = {r.origin for f in seen for r in f.requests if r.request_id.startswith(alias)}
    assert ours == {"http"}
    # charts: a History fed with the ZeroMQ snapshots the window saw holds the same series
    ref = History()
    for f in seen:
        ref.add(zmq.by_time[f.time])
    for name in ("frames", "itl", "ttft"):
        a, b = getattr(win.history, name).view(), getattr(ref, name).view()
        np.testing.assert_array_equal(a, b, err_msg=name)
    assert len(win.history.ttft) >= 1 and len(win.history.itl) >= 10


def test_wrong_key_is_refused_clearly(server, qapp, tmp_path, qtbot):
    win = _window(tmp_path, server.url, "not-the-key")
    try:
        win.start_engine()
        qtbot.waitUntil(lambda: win.state == "disconnected", timeout=60_000)
        assert "refused the API key (401)" in win.banner.text.text()
    finally:
        win.shutdown()
        win.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_restarted_kvscope_server_is_picked_up_again(tiny_dir, qapp, tmp_path, qtbot):
    port = _free_port()
    args = ["--port", str(port), "--model", str(tiny_dir), "--dtype", "float32",
            "--decode-weights", "dense",
            "--engine-args", "--num-threads 1 --num-kv-blocks 64 --telemetry-hz 20"]
    proc = ServeProc(args).wait_healthy()
    win = _window(tmp_path, proc.url, None)
    try:
        win.start_engine()
        qtbot.waitUntil(lambda: win.state in ("ready", "busy"), timeout=60_000)
        qtbot.waitUntil(lambda: win.history.latest is not None, timeout=30_000)
        first_welcome = win.welcome
        assert proc.stop() is not None
        last_old = win.history.latest.time
        qtbot.waitUntil(lambda: win.state == "not answering", timeout=60_000)
        assert "not answering" in win.banner.text.text() and win.link is not None
        proc = ServeProc(args).wait_healthy()  # the same URL, another engine behind it
        qtbot.waitUntil(lambda: win.state in ("ready", "busy") and win.welcome is not None
                        and win.welcome.client_id != first_welcome.client_id, timeout=60_000)
        assert not win.banner.isVisible()
        t0 = win.history.latest.time if win.history.latest is not None else None
        qtbot.waitUntil(lambda: win.history.latest is not None
                        and win.history.latest.time != t0, timeout=30_000)
        # the charts started over with the new engine: no rate across the two processes
        assert win.history.t0 > last_old
        assert (win.history.frames.view()[:, History.PTPS] >= 0).all()
    finally:
        win.shutdown()
        win.close()
        proc.stop()
