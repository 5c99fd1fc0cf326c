"""*Engine → KV cache* against a real engine process (tiny random model, tests/ui/engines.py):
a host tier chosen for the spawned engine shows in the status bar with its blocks and hits from
telemetry; choosing int8 restarts the engine with an int8 KV cache and the tier off."""

from __future__ import annotations

import pytest
from PySide6.QtWidgets import QApplication

from app.conversations import ConversationStore
from app.settings import open_settings
from app.supervisor import EngineOptions
from tests.ui.conftest import send_chat, tiny_engine_command
from ui.main_window import EngineSource, MainWindow, wait_until

pytestmark = pytest.mark.slow
HOST_BYTES = 1 << 20  # 128 blocks of the tiny model (2 layers · 2 · 2 heads · 16 · 4 B · 16)


def test_host_tier_then_int8_from_the_menu(qtbot, tmp_path):
    d = tmp_path / "kvscope-data"
    cmd = tiny_engine_command("--num-kv-blocks", "24", "--max-model-len", "256")
    w = MainWindow(open_settings(d), ConversationStore(d / "conversations"),
                   EngineSource(command=cmd, options=EngineOptions(kv_host_memory=HOST_BYTES)),
                   data_dir=d)
    w.resize(1400, 900)
    w.show()
    w.start_engine()
    try:
        ok = wait_until(lambda: w.state in ("ready", "busy", "disconnected"), 180,
                        QApplication.instance())
        assert ok and w.state in ("ready", "busy"), (w.last_error, w.supervisor.tail(20))
        m = w.welcome.model
        assert (m.kv_cache_dtype, m.kv_host_bytes, m.kv_disk_bytes) == ("auto", HOST_BYTES, 0)
        assert "KV tiers host 1 MiB" in w.kv_label.text()
        assert w.kv_cache_actions["host"][HOST_BYTES].isChecked()  # an extra "1 MiB" entry
        # Telemetry frames carry the tier's counters: the tier line appears.
        send_chat(w, "Tell me about paged attention and the blocks of a KV cache.", 24)
        qtbot.waitUntil(lambda: not w.status.tiers_label.isHidden(), timeout=60_000)
        assert "host tier" in w.status.tiers_label.text()
        assert "/128 blocks" in w.status.tiers_label.text()
        qtbot.waitUntil(lambda: not w.chat.active, timeout=60_000)

        w.kv_cache_actions["dtype"]["int8"].trigger()
        assert "tiers turned off" in w.statusBar().currentMessage()
        qtbot.waitUntil(lambda: w.welcome is not None and w.state in ("ready", "busy")
                        and w.welcome.model.kv_cache_dtype == "int8", timeout=180_000)
        m = w.welcome.model
        assert m.kv_host_bytes == 0 and m.kv_disk_bytes == 0
        assert "int8 2·L·H_kv·(D·1 + 2 scale) = 2·2·2·(16·1 + 2) = 144 B" in w.kv_label.text()
        assert "KV tiers" not in w.kv_label.text()
        assert w.status.tiers_label.isHidden()
        assert w.settings.value("engine/kv_cache_dtype") == "int8"
        send_chat(w, "Still there?", 6)
        conv = w.chat.current
        qtbot.waitUntil(lambda: not w.chat.busy(conv.id), timeout=60_000)
        assert conv.messages[-1].stats["completion_tokens"] == 6
        assert w.status.tiers_label.isHidden()
    finally:
        w.shutdown()
        w.close()
