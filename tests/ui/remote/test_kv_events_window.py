"""The window watching a server over HTTP (tests/app/remote/fake_server.py) and its KV events
(tests/ui/remote/fake_kv_publishers.py), offscreen: the *Prefix tree* tab's data (the layout it
draws: each block's parent, tokens and media) equals the fixture's own recount through a late
join, dropped messages, garbage frames (counted, skipped) and a restart; blocks are coloured by
medium; the hover names the holders and shows the tokens as text through /detokenize, or as
ids when the server has none; bad endpoints are refused naming the field."""

from __future__ import annotations

import argparse

import pytest
from PySide6.QtWidgets import QApplication

from app.__main__ import kv_events_arg
from app.conversations import ConversationStore
from app.remote.kv_events_source import KvEventsSource
from app.settings import open_settings
from tests.app.remote.fake_server import FakeServer, fixture_texts
from tests.ui.remote.fake_kv_publishers import MEDIA, FakeCache, FakePublisher
from ui.kv.prefix_tree import CACHED_BAR, DISK_BAR, HOST_BAR
from ui.kv.prefix_tree_layout import DISK_ONLY, HOST_ONLY, IN_POOL
from ui.window.connect_dialog import ConnectDialog
from ui.window.main_window import EngineSource, MainWindow, wait_until

FAST = {"scrape_interval": 0.1, "retry_interval": 0.2, "scrape_timeout": 5.0,
        "connect_timeout": 5.0}


@pytest.fixture
def open_window(qapp, tmp_path):
    windows: list[MainWindow] = []

    def make(url: str, kv: KvEventsSource) -> MainWindow:
        d = tmp_path / f"data{len(windows)}"
        source = EngineSource(connect=url, kv_events=kv, link_options=dict(FAST))
        w = MainWindow(open_settings(d), ConversationStore(d / "conversations"), source,
                       data_dir=d)
        windows.append(w)
        w.resize(1400, 900)
        w.show()
        w.start_engine()
        ok = wait_until(lambda: w.state in ("ready", "busy"), 30, QApplication.instance())
        assert ok, (w.state, w.last_error)
        return w

    yield make
    for w in windows:
        w.shutdown()
        w.close()


def drawn(win: MainWindow) -> dict:
    """The tab's tree: hash -> (parent hash or None for a root, tokens, media)."""
    lay = win.prefix_tree.layout_
    if lay is None:
        return {}
    return {lay.hashes[i]: (lay.hashes[p] if (p := int(lay.parent[i])) >= 0 else None,
                            tuple(lay.tokens[i]), lay.media[i])
            for i in range(lay.num_blocks)}  # fmt: skip


def recounted(pub: FakePublisher) -> dict:
    """The fixture's tree, a block whose parent is not held drawn as a root."""
    held = pub.expected()
    return {h: (p if p in held else None, toks, media) for h, (p, toks, media) in held.items()}


def settles(win: MainWindow, pub: FakePublisher, timeout: float = 30) -> bool:
    assert len(recounted(pub)) > 10
    return wait_until(lambda: drawn(win) == recounted(pub), timeout, QApplication.instance())


def source_of(pub: FakePublisher) -> KvEventsSource:
    return KvEventsSource(pub.endpoint, pub.replay_endpoint)


def test_the_tab_draws_a_vllm_servers_tree_through_loss_garbage_and_a_restart(open_window):
    with FakeServer("vllm", fixture_texts("vllm_v1")) as server, \
            FakePublisher("vllm-map") as pub:
        server.detokenize = lambda ids: "".join(chr(97 + t % 26) for t in ids)
        cache = FakeCache(seed=11, media=MEDIA["vllm-map"])
        for _ in range(80):  # before the window joins: a replay from 0 brings them
            pub.publish(cache.step())
        win = open_window(server.url, source_of(pub))
        assert win.kv_stack.currentWidget() is win.kv_tabs
        assert win.kv_tabs.currentWidget() is win.prefix_tree
        assert not win.kv_tabs.isTabVisible(win.kv_tabs.indexOf(win.block_map))
        assert win.chart_stack.currentWidget() is win.metric_charts
        assert settles(win, pub)

        for i in range(60):
            pub.publish(cache.step(), drop=i in (10, 11, 40))
        for kind in ("frames", "seq", "payload", "shape"):
            pub.send_garbage(kind)
        pub.publish(cache.step())
        assert settles(win, pub)
        stats = win.kv_events.stats()[pub.endpoint]
        assert stats.garbage == 4 and stats.lost == 0
        assert wait_until(lambda: "4 garbage frames skipped" in win.prefix_tree.note.text(), 5,
                          QApplication.instance())

        pub.restart()
        cache = FakeCache(seed=12, media=MEDIA["vllm-map"])
        for _ in range(30):
            pub.publish(cache.step())
        assert settles(win, pub)
        assert win.kv_events.stats()[pub.endpoint].restarts == 1
        _colours_and_hover(win, pub, server)


def _colours_and_hover(win: MainWindow, pub: FakePublisher, server: FakeServer) -> None:
    panel, lay = win.prefix_tree, win.prefix_tree.layout_
    panel.redraw(force=True)
    assert len(set(lay.tier.tolist())) >= 2  # a lower tier holds some blocks alone
    bar = {IN_POOL: CACHED_BAR, HOST_ONLY: HOST_BAR, DISK_ONLY: DISK_BAR}
    for i in range(lay.num_blocks):
        media = lay.media[i]  # vLLM's names: GPU, CPU, STORAGE
        want = IN_POOL if "GPU" in media else HOST_ONLY if "CPU" in media else DISK_ONLY
        assert lay.tier[i] == want and panel.kind[i] == bar[want]
    i = 0
    tokens = tuple(lay.tokens[i])
    assert f"held by 1: {pub.endpoint}" in panel.describe(i)
    text = "".join(chr(97 + t % 26) for t in tokens)
    assert wait_until(lambda: f"text: '{text}'" in panel.describe(i), 10,
                      QApplication.instance())
    assert server.detokenize_bodies[0]["model"] == "fake-model"


def test_an_sglang_server_without_detokenize_shows_token_ids(open_window):
    with FakeServer("sglang", fixture_texts("sglang")) as server, \
            FakePublisher("sglang", topic=b"kv") as pub:
        cache = FakeCache(seed=13, hash_kind="bytes", media=MEDIA["sglang"])
        for _ in range(50):
            pub.publish(cache.step())
        win = open_window(server.url, source_of(pub))
        assert settles(win, pub)
        panel = win.prefix_tree
        panel.describe(0)  # asks /detokenize: 404
        detok = win.kv_events.detokenizer
        assert wait_until(lambda: detok.supported is False, 10, QApplication.instance())
        hover = panel.describe(0)
        assert "text:" not in hover and "token ids: [" in hover


def test_the_connect_dialog_names_the_wrong_field(qapp):
    dialog = ConnectDialog(["http://127.0.0.1:8000"])
    dialog.kv_events.setText("tcp://*:5557")
    dialog.accept()
    assert dialog.error.isVisibleTo(dialog) and "KV events endpoint" in dialog.error.text()
    assert "tcp://HOST:PORT" in dialog.error.text() and "ipc://PATH" in dialog.error.text()
    dialog.kv_events.setText("")
    dialog.kv_replay.setText("tcp://h:5558")
    dialog.accept()
    assert "replay endpoint" in dialog.error.text()
    dialog.kv_events.setText(" tcp://10.0.0.5:5557 ")
    dialog.kv_replay.setText("ipc:///tmp/replay")
    assert dialog.kv_events_source() == KvEventsSource("tcp://10.0.0.5:5557", "ipc:///tmp/replay")
    dialog.accept()
    assert dialog.result() == ConnectDialog.DialogCode.Accepted


@pytest.mark.parametrize("argv, says", [
    (["--kv-events", "localhost:5557"], "--kv-events: 'localhost:5557'"),
    (["--kv-events", "tcp://h:99999"], "--kv-events: 'tcp://h:99999'"),
    (["--kv-events", "tcp://h:1", "--kv-events-replay", "udp://h:2"], "--kv-events-replay:"),
    (["--kv-events-replay", "tcp://h:2"], "given without a --kv-events"),
])  # fmt: skip
def test_the_command_line_names_the_wrong_flag(argv, says):
    args = _parse(["--connect", "http://h:8000", *argv])
    with pytest.raises(ValueError, match=None) as err:
        kv_events_arg(args)
    assert says in str(err.value)
    assert kv_events_arg(_parse(["--connect", "http://h:8000", "--kv-events", "tcp://[::1]:5"]))
    with pytest.raises(ValueError, match="needs --connect http"):
        kv_events_arg(_parse(["--kv-events", "tcp://h:5557"]))


def _parse(argv: list[str]) -> argparse.Namespace:
    from app.__main__ import build_parser

    return build_parser().parse_args(argv)
