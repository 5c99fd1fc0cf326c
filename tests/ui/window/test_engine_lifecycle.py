"""The window around its engine's life: an attached engine (`--connect`) that stops answering
(frozen with SIGSTOP) is marked "not answering" and comes back when it answers again; one that
dies is given up on (the window stays usable, replies are kept and marked); the load generator
runs again after an engine restart."""

from __future__ import annotations

import signal

import pytest

from app.conversations import ConversationStore
from app.settings import open_settings
from tests.ipc.helpers import EngineProc
from tests.ui.conftest import TINY_ENGINE_ARGS, send_chat, tiny_engine_command
from ui.window.main_window import EngineSource, MainWindow

pytestmark = pytest.mark.slow
STALL_TIMEOUT = 4.0  # seconds of silence before "not answering" (and again before giving up)


def _window(tmp_path, source: EngineSource) -> MainWindow:
    d = tmp_path / "kvscope-data"
    w = MainWindow(open_settings(d), ConversationStore(d / "conversations"), source, data_dir=d)
    w.resize(1200, 800)
    w.show()
    w.start_engine()
    return w


def test_attached_engine_not_answering_recovers_then_is_given_up_when_it_dies(qtbot, tmp_path):
    engine = EngineProc([*TINY_ENGINE_ARGS, "--heartbeat-interval", "0.2"])
    win = _window(tmp_path, EngineSource(connect=engine.endpoint, stall_timeout=STALL_TIMEOUT))
    try:
        qtbot.waitUntil(lambda: win.state == "ready", timeout=120_000)
        # Frozen: no heartbeat, no telemetry. Attached, the window has only the silence to go by.
        engine.proc.send_signal(signal.SIGSTOP)
        qtbot.waitUntil(lambda: win.state == "not answering", timeout=60_000)
        assert win.banner.isVisible() and "not answering" in win.banner.text.text()
        engine.proc.send_signal(signal.SIGCONT)
        qtbot.waitUntil(lambda: win.state == "ready", timeout=60_000)
        assert not win.banner.isVisible()
        # Still serving after the recovery.
        send_chat(win, "Still there?", 6)
        conv = win.chat.current
        qtbot.waitUntil(lambda: not win.chat.busy(conv.id), timeout=60_000)
        assert conv.messages[-1].stats["completion_tokens"] == 6
        # Killed mid-reply: not answering, then (no process to watch) given up on.
        send_chat(win, "Keep talking.", 400)
        reply = win.chat.current.messages[-1]
        qtbot.waitUntil(lambda: len(reply.content) > 0, timeout=60_000)
        engine.proc.kill()
        qtbot.waitUntil(lambda: win.state == "not answering", timeout=60_000)
        qtbot.waitUntil(lambda: win.state == "disconnected", timeout=60_000)
        assert win.last_error == "the engine stopped answering"
        assert "attached with --connect" in win.banner.log.toPlainText()
        assert reply.interrupted and reply.content  # the text so far is kept, marked
        assert not win.chat.send_btn.isEnabled() and win.banner.restart_btn.isEnabled()
    finally:
        engine.proc.send_signal(signal.SIGCONT)
        win.shutdown()
        win.close()
        engine.stop()


def test_load_generator_runs_again_after_an_engine_restart(qtbot, tmp_path):
    win = _window(tmp_path, EngineSource(command=tiny_engine_command("--num-kv-blocks", "96")))
    stats: list[dict] = []
    panel = win.load_panel
    try:
        qtbot.waitUntil(lambda: win.state in ("ready", "busy"), timeout=180_000)
        for box, value in zip(panel.boxes().values(), (3, 32, 4, 8), strict=True):
            box.setValue(value)  # concurrency, system prompt, output min and max
        for run in range(2):
            link = win.link
            link.load_stats.connect(stats.append)
            stats.clear()
            panel.button.click()
            qtbot.waitUntil(lambda: any(s.get("finished", 0) >= 3 for s in stats), timeout=120_000)
            assert all(s.get("errors", 0) == 0 for s in stats)
            if run == 0:
                win.restart_engine()  # while the load runs
                assert not panel.button.isChecked() and panel.button.text() == "Start load"
                qtbot.waitUntil(lambda old=link: win.state in ("ready", "busy")
                                and win.link not in (None, old), timeout=180_000)  # fmt: skip
                assert panel.isEnabled()
        panel.button.click()  # stop
        assert panel.button.text() == "Start load"
    finally:
        win.shutdown()
        win.close()
