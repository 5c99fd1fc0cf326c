"""The window attached over HTTP to servers that are not KVScope (`--connect http://...`):
scripted stand-ins for vLLM (recent and older names), SGLang and llama.cpp's server serve the
/metrics fixtures (tests/app/remote/fixtures) and an OpenAI chat stream
(tests/app/remote/fake_server.py).

The scrape clock is scripted (100 s, then 102 s for every later scrape), so what the window shows
is exactly what the two fixture scrapes imply over 2 s (the values worked out in
tests/app/remote/fixtures/README.md and tests/app/remote/test_metrics.py), however slow this machine
is. """

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
from PySide6.QtCore import QTimer
from PySide6.QtGui import QImage
from PySide6.QtWidgets import QApplication

from app.conversations import ConversationStore
from app.settings import open_settings
from tests.app.remote.fake_server import ChatScript, FakeServer, fixture_texts
from tests.ui.conftest import tiny_engine_command
from ui.remote.charts import NOT_REPORTED
from ui.window.main_window import EngineSource, MainWindow, wait_until

FAST = {"scrape_interval": 0.1, "retry_interval": 0.2, "scrape_timeout": 5.0,
        "connect_timeout": 5.0}


def scripted_clock():
    ticks = itertools.chain([100.0], itertools.repeat(102.0))
    return lambda: next(ticks)


@pytest.fixture
def open_window(qapp, tmp_path):
    windows: list[MainWindow] = []

    def make(url: str, api_key: str | None = None, wait: bool = True, **link) -> MainWindow:
        d = tmp_path / f"data{len(windows)}"
        source = EngineSource(connect=url, api_key=api_key,
                              link_options={**FAST, "clock": scripted_clock(), **link})
        w = MainWindow(open_settings(d), ConversationStore(d / "conversations"), source,
                       data_dir=d)
        windows.append(w)
        w.resize(1400, 900)
        w.show()
        w.start_engine()
        if wait:
            ok = wait_until(lambda: w.state != "starting", 30, QApplication.instance())
            assert ok and w.state in ("ready", "busy"), (w.state, w.last_error)
        return w

    yield make
    for w in windows:
        w.shutdown()
        w.close()


def _settle(win: MainWindow, samples: int = 3) -> None:
    """Until the window holds `samples` scrapes (the second fixture from the second on)."""
    assert wait_until(lambda: win.metric_history.n >= samples, 30, QApplication.instance())
    win.redraw_now()


# (fixture, status-bar name, titles, aggregate total, (rank, detail) rows, missing)
KINDS = {
    "vllm_v1": ("vLLM", {
        "requests": "requests: running 5 · waiting 3",
        "kv": "KV cache usage: 30% (mean of 2 ranks)",
        "hit": "prefix hit rate (2 s): 50%",
        "tps": "throughput tok/s: prompt 1,000 · generation 200",
        "preempt": "preemptions/s: 1",
        "ttft": "TTFT ms (2 s): p50 60.0 · p90 80.0 · p99 475",
        "itl": "ITL ms (2 s): p50 25.0 · p90 50.0 · p99 72.5",
    }, "KV cache usage 30% (mean of 2 ranks)",
        [("engine 0", "25% ≈ 6,750 of 27,000 blocks"),
         ("engine 1", "35% ≈ 9,450 of 27,000 blocks")], set()),
    "vllm_v0": ("vLLM", {
        "requests": "requests: running 6 · waiting 0",
        "kv": "KV cache usage: 60%",
        "hit": "prefix hit rate (2 s): 25%",
        "tps": "throughput tok/s: prompt 300 · generation 50",
        "preempt": f"preemptions/s: {NOT_REPORTED}",
        "ttft": f"TTFT: {NOT_REPORTED}",
        # ten observations at 0.03 s, in (0.025, 0.05]: 25 + 25 q ms
        "itl": "ITL ms (2 s): p50 37.5 · p90 47.5 · p99 49.8",
    }, "KV cache usage 60%", [("all", "60% (the pool's size is not reported)")],
        {"ttft", "preempt"}),
    "sglang": ("SGLang", {
        "requests": "requests: running 8 · waiting 2",
        "kv": "KV cache usage: 30% (mean of 2 ranks)",
        "hit": "prefix hit rate (2 s): 40%",
        "tps": "throughput tok/s: prompt 500 · generation 250",
        "preempt": f"preemptions/s: {NOT_REPORTED}",
        "ttft": "TTFT ms (2 s): p50 194 · p90 875 · p99 988",
        "itl": f"ITL: {NOT_REPORTED}",
    }, "KV cache usage 30% (mean of 2 ranks)",
        [("dp 0 · tp 0 · pp 0", "20% ≈ 32,344 of 161,721 tokens"),
         ("dp 1 · tp 0 · pp 0", "40% ≈ 64,688 of 161,721 tokens")], {"itl", "preempt"}),
    "llamacpp": ("llama.cpp server", {
        "requests": "requests: running 2 · waiting 3",
        "kv": f"KV cache usage: {NOT_REPORTED}",
        "hit": f"prefix hit rate: {NOT_REPORTED}",
        "tps": "throughput tok/s: prompt 150 · generation 300",
        "preempt": f"preemptions/s: {NOT_REPORTED}",
        "ttft": f"TTFT: {NOT_REPORTED}",
        "itl": f"ITL: {NOT_REPORTED}",
    }, f"KV cache usage: {NOT_REPORTED}", [], {"kv", "hit", "preempt", "ttft", "itl"}),
}


@pytest.mark.parametrize("fixture", list(KINDS))
def test_the_window_shows_what_the_fixture_implies(open_window, fixture):
    name, titles, total, rank_rows, missing = KINDS[fixture]
    with FakeServer("someone", fixture_texts(fixture)) as fake:
        win = open_window(fake.url)
        _settle(win)
        # detected from the metric prefixes (owned_by says "someone"), said in the status bar
        assert win.model_label.text().startswith(f"{name} · fake-model · {fake.url}")
        assert win.state == "busy"  # requests are running
        charts = win.metric_charts
        assert win.chart_stack.currentWidget() is charts
        assert win.kv_stack.currentWidget() is win.kv_aggregate
        assert charts.titles == titles
        for key, note in charts.notes.items():  # across the plot, not a zero line
            assert note.isVisible() == (key in missing), key
        agg = win.kv_aggregate
        assert agg.total.text() == total and agg.rank_texts() == rank_rows
        assert "Aggregate KV view" in agg.header.text() and name in agg.header.text()
        status = win.remote_label.text()
        if missing:
            assert win.remote_label.isVisible() and "not reported by this server" in status
            if "ttft" in missing:
                assert "TTFT" in status
            if "kv" in missing:
                assert "KV cache usage" in status
        else:
            assert not win.remote_label.isVisible()


def test_per_rank_table_and_what_needs_the_engine_protocol(open_window):
    with FakeServer("vllm", fixture_texts("vllm_v1")) as fake:
        win = open_window(fake.url)
        _settle(win)
        # engine 0: prompt 5000 -> 6200 and generation 2000 -> 2300 in 2 s, hits 300 of 600
        assert win.kv_aggregate.table_rows() == [
            ("engine 0", "4", "2", "25%", "600", "150", "50%"),
            ("engine 1", "1", "1", "35%", "400", "50", "50%"),
        ]
        assert "27,000 blocks × 16 tokens per rank" in win.kv_label.text()
        # engine controls need the ZeroMQ protocol: greyed out, saying why
        assert not win.controls.isEnabled()
        assert "engine protocol" in win.controls.toolTip()
        assert "engine protocol" in win.controls.sliders["max_num_seqs"].toolTip()
        assert not win.api_action.isEnabled() and not win.decode_weights_menu.isEnabled()
        assert win.local_action.isVisible() and win.restart_action.text() == "&Reconnect"


def test_llamacpp_rank_table_says_not_reported(open_window):
    with FakeServer("llamacpp", fixture_texts("llamacpp")) as fake:
        win = open_window(fake.url)
        _settle(win)
        assert win.kv_aggregate.table_rows() == [("all", "2", "3", "n/r", "150", "300", "n/r")]
        assert win.kv_aggregate.pool.text() == "pool size: not reported by this server"


def _send(win: MainWindow, text: str) -> str:
    win.chat.new_conversation()
    win.chat.input.setPlainText(text)
    rid = win.chat.send_current()
    assert rid is not None
    return rid


def test_chat_streams_with_its_reply_line(open_window, qtbot):
    script = ChatScript(words=["Paged", " blocks", " hold", " keys", "."], delay=0.05)
    with FakeServer("vllm", fixture_texts("vllm_v1"), chat=script) as fake:
        win = open_window(fake.url)
        batches: list[list[str]] = []
        win.link.replies.connect(lambda msgs: batches.append([type(m).__name__ for m in msgs]))
        win.chat.temperature.setValue(0.0)
        win.chat.max_tokens.setValue(5)
        _send(win, "What is a block?")
        reply = win.chat.current.messages[-1]
        # `batches` is a second receiver of the same signal: wait for it as well as the panel
        qtbot.waitUntil(lambda: not win.chat.busy() and batches and batches[-1][-1] == "Finish",
                        timeout=20_000)
        assert reply.content == "Paged blocks hold keys." and not reply.interrupted
        assert len(batches) >= 2 and batches[-1][-1] == "Finish"  # streamed, not one blob
        line = win.chat._view_for(reply).stats.text()
        assert line.startswith("TTFT ") and " tok/s · " in line
        assert "prompt 12 / cached 8 / generated 5 · stop" in line
        # the reply's TTFT and tok/s come from the stream's own timing
        assert 0 < reply.stats["ttft"] < reply.stats["e2e"]
        assert reply.stats["tok_s"] == pytest.approx(4 / (reply.stats["e2e"]
                                                          - reply.stats["ttft"]), rel=0.5)
        body = fake.chat_bodies[-1]
        assert body["model"] == "fake-model" and body["max_tokens"] == 5
        assert body["temperature"] == 0.0 and body["stream"] is True
        assert body["messages"][-1] == {"role": "user", "content": "What is a block?"}
        # a server that does not report cached tokens: the line says nothing about them
        fake.chat = ChatScript(usage={"prompt_tokens": 12, "completion_tokens": 5})
        _send(win, "Again?")
        reply = win.chat.current.messages[-1]
        qtbot.waitUntil(lambda: not win.chat.busy(), timeout=20_000)
        line = win.chat._view_for(reply).stats.text()
        assert "prompt 12 / generated 5" in line and "cached" not in line


def test_stop_closes_the_stream(open_window, qtbot):
    script = ChatScript(words=[f" w{i}" for i in range(400)], delay=0.02)
    with FakeServer("vllm", fixture_texts("vllm_v1"), chat=script) as fake:
        win = open_window(fake.url)
        win.chat.max_tokens.setValue(400)
        _send(win, "Talk.")
        reply = win.chat.current.messages[-1]
        qtbot.waitUntil(lambda: len(reply.content) > 0, timeout=20_000)
        win.chat.stop_current()
        qtbot.waitUntil(lambda: not win.chat.busy(), timeout=20_000)
        assert reply.interrupted and reply.stats["finish_reason"] == "abort"
        assert reply.stats["interrupted_by"] == "stopped"
        qtbot.waitUntil(lambda: fake.streams_closed_by_client == 1, timeout=20_000)
        assert 0 < len(reply.content.split()) < 400 and fake.streams_open == 0
        assert win.state in ("ready", "busy") and win.chat.send_btn.isEnabled()


@pytest.mark.parametrize("script,why", [
    (ChatScript(words=["a", "b", "c", "d"], cut_after=2), "interrupted: the stream"),
    (ChatScript(error_event="out of KV blocks"), "interrupted: the server reported an error: "
                                                 "out of KV blocks"),
    (ChatScript(status=400), "engine refused the request"),
])
def test_a_broken_reply_is_marked_and_the_window_carries_on(open_window, qtbot, script, why):
    with FakeServer("vllm", fixture_texts("vllm_v1"), chat=script) as fake:
        win = open_window(fake.url)
        _send(win, "Hi")
        reply = win.chat.current.messages[-1]
        qtbot.waitUntil(lambda: not win.chat.busy(), timeout=20_000)
        assert reply.interrupted and reply.stats["interrupted_by"].startswith(why)
        if script.cut_after:
            assert reply.content == "ab"  # the text so far is kept
        assert win.state in ("ready", "busy") and not win.banner.isVisible()
        assert win.chat.send_btn.isEnabled()


def test_the_load_generator_drives_the_server(open_window, qtbot):
    script = ChatScript(words=["x"] * 6, delay=0.05)
    with FakeServer("vllm", fixture_texts("vllm_v1"), chat=script) as fake:
        win = open_window(fake.url)
        lp = win.load_panel
        lp.concurrency.setValue(3)
        lp.system_tokens.setValue(32)
        lp.min_out.setValue(4)
        lp.max_out.setValue(6)
        lp.button.click()
        qtbot.waitUntil(lambda: fake.max_streams_open >= 3, timeout=20_000)
        qtbot.waitUntil(lambda: "done 0 " not in lp.stats.text() and "done" in lp.stats.text(),
                        timeout=20_000)
        body = fake.chat_bodies[0]
        assert body["messages"][0]["role"] == "system" and body["ignore_eos"] is True
        assert 4 <= body["max_tokens"] <= 6
        stopped: list[dict] = []  # the link's stats once it has processed the stop
        win.link.load_stats.connect(lambda s: s.get("running") is False and stopped.append(s))
        lp.button.click()  # stop: what is in flight is closed
        # (streams_open alone can read 0 between requests, before the link saw the stop)
        qtbot.waitUntil(lambda: bool(stopped) and fake.streams_open == 0, timeout=20_000)
        n = len(fake.chat_bodies)
        qtbot.wait(500)
        assert len(fake.chat_bodies) == n  # and nothing new is sent


def test_unreachable_wrong_key_and_not_openai(open_window, qtbot):
    with FakeServer("vllm", fixture_texts("vllm_v1")) as fake:
        url = fake.url
    win = open_window(url, wait=False)  # nothing listens there now
    qtbot.waitUntil(lambda: win.state == "disconnected", timeout=30_000)
    assert win.banner.isVisible() and f"Cannot watch {url}" in win.banner.text.text()
    assert "cannot reach" in win.banner.text.text()
    assert win.banner.restart_btn.text() == "Reconnect" and not win.chat.send_btn.isEnabled()
    win.chat.input.setPlainText("still typing")  # responsive
    with FakeServer("vllm", fixture_texts("vllm_v1"), api_key="right-key") as fake:
        win = open_window(fake.url, api_key="wrong-key", wait=False)
        qtbot.waitUntil(lambda: win.state == "disconnected", timeout=30_000)
        assert "refused the API key (401)" in win.banner.text.text()
        fake.models_body = b"<html><body>It works!</body></html>"
        win = open_window(fake.url, api_key="right-key", wait=False)
        qtbot.waitUntil(lambda: win.state == "disconnected", timeout=30_000)
        assert "is not an OpenAI-compatible server" in win.banner.text.text()


@pytest.mark.parametrize("raw,why", [
    (b"<html>\x00\x01{{{ not metrics", "metrics: "),
    (b"# " + b"x" * (9 << 20), "metrics: /metrics is over the 8 MiB limit"),
    (None, "metrics: GET /metrics answered HTTP 404"),
])
def test_unreadable_metrics_are_said_and_chat_still_works(open_window, qtbot, raw, why):
    with FakeServer("vllm", [], chat=ChatScript(words=["ok"])) as fake:
        fake.metrics_raw = raw
        win = open_window(fake.url)
        qtbot.waitUntil(lambda: win.remote_label.text().startswith(why), timeout=30_000)
        assert "not reported by this server" in win.remote_label.text()
        assert win.state == "ready" and not win.banner.isVisible()
        _send(win, "Hi")
        qtbot.waitUntil(lambda: not win.chat.busy(), timeout=20_000)
        assert win.chat.current.messages[-1].content == "ok"


def test_a_server_that_restarts_is_picked_up_again(open_window, qtbot):
    fake = FakeServer("vllm", fixture_texts("vllm_v1")).start()
    try:
        win = open_window(fake.url, clock=__import__("time").monotonic)
        _settle(win, 2)
        fake.stop()
        qtbot.waitUntil(lambda: win.state == "not answering", timeout=30_000)
        assert win.banner.isVisible() and "not answering" in win.banner.text.text()
        qtbot.wait(500)  # still retrying, never given up
        assert win.link is not None and win.state == "not answering"
        fake.metrics = fixture_texts("sglang")  # it comes back as something else, same port
        fake.kind = "sglang"
        fake.start()
        qtbot.waitUntil(lambda: win.state in ("ready", "busy"), timeout=30_000)
        assert not win.banner.isVisible()
        qtbot.waitUntil(lambda: win.model_label.text().startswith("SGLang"), timeout=30_000)
        n = win.metric_history.n
        qtbot.waitUntil(lambda: win.metric_history.n > n + 1, timeout=30_000)
    finally:
        fake.stop()


def test_connect_dialog_remembers_urls_not_keys(open_window, qtbot):
    with FakeServer("vllm", fixture_texts("vllm_v1"), api_key="the-secret-key") as fake, \
            FakeServer("llamacpp", fixture_texts("llamacpp")) as other:
        win = open_window(fake.url, api_key="the-secret-key")
        win.open_connect_dialog()
        dialog = win.connect_dialog
        assert dialog is not None and dialog.isVisible()
        dialog.url.setCurrentText("ftp://nowhere")
        dialog.accept()  # refused: stays open and says why
        assert dialog.isVisible() and "http://" in dialog.error.text()
        dialog.url.setCurrentText(other.url + "/v1/")  # a base URL as OpenAI clients take it
        dialog.accept()
        qtbot.waitUntil(lambda: win.model_label.text().startswith("llama.cpp server"),
                        timeout=30_000)
        win.open_connect_dialog()
        dialog = win.connect_dialog
        urls = [dialog.url.itemText(i) for i in range(dialog.url.count())]
        assert urls == [other.url]  # --connect itself is not a dialog choice
        dialog.reject()
        win.settings.sync()
        text = open(win.settings.fileName(), encoding="utf-8").read()
        assert other.url in text and "the-secret-key" not in text


@pytest.mark.slow
def test_the_gui_thread_keeps_working_while_a_slow_server_is_scraped(open_window, qtbot):
    """A scrape that takes 5 s runs on the link's thread: while the server holds one, the GUI
    thread runs its timers and appends streamed tokens (a scrape on the GUI thread would freeze
    both for its whole length). How long the loop's events wait is a measurement, not a test
    (`python -m app --connect URL --measure-latency S`)."""
    script = ChatScript(words=[f" w{i}" for i in range(100)], delay=0.05)
    with FakeServer("vllm", fixture_texts("vllm_v1"), chat=script) as fake:
        fake.metrics_delay = 5.0
        win = open_window(fake.url, scrape_interval=0.5, scrape_timeout=10.0,
                          connect_timeout=10.0, wait=False)
        qtbot.waitUntil(lambda: win.state in ("ready", "busy"), timeout=30_000)
        # (ticks while a scrape is in flight, reply length at each such tick)
        during_scrape: list[int] = []
        reply_words = lambda: len(win.chat.current.messages[-1].content.split())  # noqa: E731
        timer = QTimer()
        timer.setInterval(20)
        timer.timeout.connect(
            lambda: fake.metrics_in_flight and during_scrape.append(reply_words()))
        win.chat.max_tokens.setValue(100)
        _send(win, "Stream while the scrape waits.")
        timer.start()
        qtbot.waitUntil(lambda: reply_words() == 100, timeout=60_000)
        qtbot.waitUntil(lambda: fake.metrics_requests >= 3, timeout=30_000)
        timer.stop()
        assert win.state in ("ready", "busy")
        # the GUI thread ran while scrapes were held, and the reply grew meanwhile
        assert len(during_scrape) >= 2, during_scrape
        assert during_scrape[-1] > during_scrape[0], during_scrape


@pytest.mark.slow
def test_command_line_connect_with_a_key(tmp_path):
    """`python -m app --connect http://... --api-key KEY`: the whole start-up path, rendered."""
    out = tmp_path / "shot.png"
    with FakeServer("sglang", fixture_texts("sglang"), api_key="cli-key-0123") as fake:
        env = dict(os.environ, QT_QPA_PLATFORM="offscreen", KVSCOPE_DATA_DIR=str(tmp_path / "d"))
        env.pop("KVSCOPE_API_KEY", None)
        proc = subprocess.run(
            [sys.executable, "-m", "app", "--connect", fake.url + "/v1", "--api-key",
             "cli-key-0123", "--screenshot", str(out), "--settle", "2", "--timeout", "60"],
            env=env, capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "engine busy" in proc.stdout, proc.stdout  # SGLang's fixture has requests running
        assert fake.chat_bodies and fake.metrics_requests >= 2  # the screenshot's chat, scrapes
        bad = subprocess.run([sys.executable, "-m", "app", "--connect", "http://", "--screenshot",
                              str(out)], env=env, capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and "--connect: server URL needs a host" in bad.stderr
    img = QImage(str(out))
    assert not img.isNull() and img.width() >= 800


@pytest.mark.slow
def test_back_to_the_local_engine_and_out_again(qapp, tmp_path, qtbot):
    d = tmp_path / "data"
    with FakeServer("vllm", fixture_texts("vllm_v1")) as fake:
        source = EngineSource(connect=fake.url, link_options=dict(FAST),
                              command=tiny_engine_command("--num-kv-blocks", "64"))
        win = MainWindow(open_settings(d), ConversationStore(d / "conversations"), source,
                         data_dir=d)
        win.show()
        try:
            win.start_engine()
            qtbot.waitUntil(lambda: win.remote_info is not None, timeout=30_000)
            assert win.kv_stack.currentWidget() is win.kv_aggregate
            win.use_local_engine()  # spawns this window's own engine
            qtbot.waitUntil(lambda: win.state in ("ready", "busy"), timeout=180_000)
            qtbot.waitUntil(lambda: win.history.latest is not None, timeout=30_000)
            assert win.kv_stack.currentWidget() is win.kv_tabs
            assert win.chart_stack.currentWidget() is win.charts
            assert win.controls.isEnabled() and "engine protocol" not in win.controls.toolTip()
            assert "engine protocol" not in win.controls.sliders["max_num_seqs"].toolTip()
            assert win.api_action.isEnabled() and win.decode_weights_menu.isEnabled()
            assert not win.local_action.isVisible() and not win.remote_label.isVisible()
            assert win.restart_action.text() == "&Restart engine"
            engine = win.supervisor
            win.connect_to(fake.url)  # and out again: the spawned engine is stopped
            qtbot.waitUntil(lambda: win.remote_info is not None, timeout=30_000)
            assert win.supervisor is None and not engine.running()
            assert not win.controls.isEnabled() and win.local_action.isVisible()
        finally:
            win.shutdown()
            win.close()
