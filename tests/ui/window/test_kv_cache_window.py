"""*Engine → KV cache* against a real engine process (tiny random model, tests/ui/engines.py): a
host tier chosen for the spawned engine shows in the status bar and in the tiers strip under the
block map, with numbers worked out by hand from the telemetry counters and the block size;
choosing int8 keeps the tier (an int8 block is values and scales) and a prompt sent again is
loaded back from it with the same reply; turning the tier off hides the strip."""

from __future__ import annotations

import pytest
from PySide6.QtWidgets import QApplication

from app.conversations import ConversationStore
from app.settings import open_settings
from app.supervisor import EngineOptions
from tests.ui.conftest import send_chat, tiny_engine_command
from ui.window.main_window import EngineSource, MainWindow, wait_until

pytestmark = pytest.mark.slow
HOST_BYTES = 1 << 20
# The tiny model: 2 layers, 2 KV heads, head_dim 16, 16-token blocks. float32 K and V:
# 2·2·2·16·4 = 512 B/token, 8 KiB a block, 128 blocks in 1 MiB. int8: 2·2·2·(16 + 2 scale)
# = 144 B/token, 2,304 B a block, 455 blocks in 1 MiB.
BLOCK_BYTES = {"auto": 8192, "int8": 2304}
HOST_BLOCKS = {"auto": 128, "int8": 455}
HOST_HELD = {"auto": "1.0 MiB", "int8": "1,023.8 KiB"}  # whole blocks: 455 · 2,304 B
POOL_BLOCKS = 24
# Two chats of about 14 blocks each (194 prompt tokens, the template, 6 replies) overflow the
# 24-block pool: the second evicts the first one's tail blocks into the host tier, and the
# first, sent again, loads them back.
LONG_A = "Tell me everything about paged attention and the blocks of a KV cache. " * 12
LONG_B = "Explain prefix caching, chunked prefill and preemption in a serving engine. " * 12


def _wait_ready(qtbot, w: MainWindow, kv_dtype: str, host: int) -> None:
    qtbot.waitUntil(lambda: w.welcome is not None and w.state in ("ready", "busy")
                    and w.welcome.model.kv_cache_dtype == kv_dtype
                    and w.welcome.model.kv_host_bytes == host, timeout=180_000)  # fmt: skip


def _chat(qtbot, w: MainWindow, text: str) -> str:
    send_chat(w, text, 6)
    conv = w.chat.current
    qtbot.waitUntil(lambda: not w.chat.busy(conv.id), timeout=60_000)
    assert conv.messages[-1].stats["completion_tokens"] == 6
    return conv.messages[-1].content


def _check_strip(qtbot, w: MainWindow, kv_dtype: str) -> None:
    """The strip's pool and host columns against the latest counters, by hand."""
    qtbot.waitUntil(lambda: w.history.latest is not None
                    and w.tier_panel.frame is w.history.latest and w.tier_panel.isVisible()
                    and w.history.latest.counters.get("kv_host_hits", 0) > 0,
                    timeout=30_000)  # fmt: skip
    c = w.history.latest.counters
    kib = BLOCK_BYTES[kv_dtype] / 1024
    pool, host = w.tier_panel.texts
    held = c["num_blocks_in_use"] + c["num_blocks_cached"]
    assert pool[:3] == ("POOL", f"{held:.0f}/{POOL_BLOCKS} blocks",
                        f"{held * kib:.1f} KiB of {POOL_BLOCKS * kib:.1f} KiB · "
                        f"{(c['prefix_cache_hits'] - c['external_prefix_cache_hits']) / 16:.0f} "
                        "hits")  # fmt: skip
    blocks, hits, stores = c["kv_host_blocks"], c["kv_host_hits"], c["kv_host_stores"]
    assert host[:3] == ("HOST", f"{blocks:.0f}/{HOST_BLOCKS[kv_dtype]} blocks",
                        f"{blocks * kib:.1f} KiB of {HOST_HELD[kv_dtype]} · {hits:.0f} hits")
    assert host[3].startswith(f"loaded {hits * kib:.1f} KiB · stored {stores * kib:.1f} KiB · ")
    assert host[3].endswith("/load")


def test_host_tier_then_int8_from_the_menu(qtbot, tmp_path):
    d = tmp_path / "kvscope-data"
    cmd = tiny_engine_command("--num-kv-blocks", str(POOL_BLOCKS), "--max-model-len", "256")
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
        assert not w.tier_panel.isVisible()  # no telemetry yet
        first = [_chat(qtbot, w, LONG_A), _chat(qtbot, w, LONG_B), _chat(qtbot, w, LONG_A)]
        assert first[2] == first[0]  # loaded back from the host tier: the same reply
        assert "host tier" in w.status.tiers_label.text()
        assert f"/{HOST_BLOCKS['auto']} blocks" in w.status.tiers_label.text()
        _check_strip(qtbot, w, "auto")

        w.kv_cache_actions["dtype"]["int8"].trigger()  # the tier stays
        _wait_ready(qtbot, w, "int8", HOST_BYTES)
        assert "int8 2·L·H_kv·(D·1 + 2 scale) = 2·2·2·(16·1 + 2) = 144 B" in w.kv_label.text()
        assert "KV tiers host 1 MiB" in w.kv_label.text()
        assert w.settings.value("engine/kv_cache_dtype") == "int8"
        replies = [_chat(qtbot, w, LONG_A), _chat(qtbot, w, LONG_B), _chat(qtbot, w, LONG_A)]
        assert replies[2] == replies[0]
        _check_strip(qtbot, w, "int8")

        w.kv_cache_actions["host"][0].trigger()  # no tier: no strip, no tier line
        _wait_ready(qtbot, w, "int8", 0)
        _chat(qtbot, w, "Still there?")
        qtbot.waitUntil(lambda: w.history.latest is not None
                        and w.tier_panel.frame is w.history.latest, timeout=30_000)
        assert w.tier_panel.isHidden() and w.status.tiers_label.isHidden()
        assert "KV tiers" not in w.kv_label.text()
    finally:
        w.shutdown()
        w.close()
