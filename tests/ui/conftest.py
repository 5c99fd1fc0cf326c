"""GUI tests run headless; the engine (when a test needs one) is a real `engine_proc serve`
process over a tiny random model (tests/ui/engines.py), one per test module."""

from __future__ import annotations

import contextlib
import os
import sys

os.environ["QT_QPA_PLATFORM"] = "offscreen"
os.environ.setdefault("QT_LOGGING_RULES", "qt.qpa.*=false")

import pytest  # noqa: E402

import ui  # noqa: E402,F401  (applies the PySide6 refcount workaround before any Qt call)

TINY_ENGINE_ARGS = ["--engine-factory", "tests.ui.engines:tiny_chat", "--num-threads", "1",
                    "--telemetry-hz", "20", "--log-level", "INFO"]


def tiny_engine_command(*extra: str) -> list[str]:
    return [sys.executable, "-m", "engine_proc", "serve", *TINY_ENGINE_ARGS, *extra]


@pytest.fixture(scope="session", autouse=True)
def gc_on_gui_thread(qapp):
    """As in the app: cycles are collected on the GUI thread only (ui.qt_compat says why); once
    set, for the rest of this worker's session (tests/conftest.py collects between tests)."""
    from ui.qt_compat import collect_garbage_on_gui_thread

    return collect_garbage_on_gui_thread()


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    d = tmp_path / "kvscope-data"
    monkeypatch.setenv("KVSCOPE_DATA_DIR", str(d))
    return d


def send_chat(win, text: str, max_tokens: int) -> None:
    """A new greedy conversation with `text`, sent from the chat panel."""
    win.chat.temperature.setValue(0.0)
    win.chat.max_tokens.setValue(max_tokens)
    win.chat.new_conversation()
    win.chat.input.setPlainText(text)
    assert win.chat.send_current() is not None


class DictSettings:
    """QSettings' value/setValue over a dict (no file, no Qt)."""

    def __init__(self, values: dict) -> None:
        self.values = dict(values)

    def value(self, key: str):
        return self.values.get(key)

    def setValue(self, key: str, value) -> None:  # noqa: N802 - QSettings' name
        self.values[key] = value


@contextlib.contextmanager
def window_on_tiny_engine(data_dir, *engine_args: str, show: bool = True):
    """A MainWindow that spawned `engine_proc serve` on the tiny model and is ready, closed on
    exit (a module fixture's body)."""
    from PySide6.QtWidgets import QApplication

    from app.conversations import ConversationStore
    from app.settings import open_settings
    from ui.window.main_window import EngineSource, MainWindow, wait_until

    w = MainWindow(open_settings(data_dir), ConversationStore(data_dir / "conversations"),
                   EngineSource(command=tiny_engine_command(*engine_args)), data_dir=data_dir)
    if show:
        w.resize(1400, 900)
        w.show()
    w.start_engine()
    ok = wait_until(lambda: w.state in ("ready", "busy", "disconnected"), 180,
                    QApplication.instance())
    assert ok and w.state in ("ready", "busy"), (w.state, w.last_error,
                                                 w.supervisor and w.supervisor.tail(20))
    try:
        yield w
    finally:
        w.shutdown()
        w.close()
