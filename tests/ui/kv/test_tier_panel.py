"""The KV tiers strip under the block map (ui/kv/tier_panel.py): what each column says for
telemetry counters whose numbers are worked out by hand here, that it repaints only on a change,
and that it hides for an engine without lower tiers. With a real engine:
tests/ui/window/test_kv_cache_window.py."""

from __future__ import annotations

import numpy as np
from PySide6.QtWidgets import QVBoxLayout, QWidget

from ui.kv.tier_panel import TierPanel, row_texts, short_seconds, tier_rows
from ui.telemetry import Frame

KIB = 1024
# A pool of 28 blocks of 1 KiB, 4 tokens each; a host tier of 36 blocks; a disk tier of
# 10 entries of 1 KiB + a 120-byte header.
COUNTERS = {
    "block_size": 4.0,
    "num_blocks_total": 28.0, "num_blocks_in_use": 6.0, "num_blocks_cached": 10.0,
    "num_blocks_empty": 12.0, "kv_pool_bytes": 28.0 * KIB,
    "prefix_cache_queries": 900.0, "prefix_cache_hits": 200.0,
    "external_prefix_cache_queries": 500.0, "external_prefix_cache_hits": 120.0,
    "kv_host_blocks_total": 36.0, "kv_host_blocks": 9.0, "kv_host_bytes_total": 36.0 * KIB,
    "kv_host_bytes_used": 9.0 * KIB, "kv_host_hits": 20.0, "kv_host_bytes_loaded": 20.0 * KIB,
    "kv_host_bytes_stored": 40.0 * KIB, "kv_host_load_seconds": 0.0017,
    "kv_disk_blocks_total": 10.0, "kv_disk_blocks": 4.0, "kv_disk_bytes_total": 11440.0,
    "kv_disk_bytes_used": 4 * 1144.0, "kv_disk_hits": 5.0, "kv_disk_bytes_loaded": 5 * 1144.0,
    "kv_disk_bytes_stored": 12 * 1144.0, "kv_disk_load_seconds": 0.012,
    "kv_disk_writable": 1.0,
}  # fmt: skip
# By hand: pool 6 + 10 = 16 of 28 blocks, 16 KiB of 28 KiB; (200 - 120) / 4 = 20 blocks hit in
# the pool. Host 9 KiB of 36 KiB, 1.7 ms / 20 loads = 85 µs. Disk 4 · 1144 = 4,576 B = 4.5 KiB
# of 11,440 B = 11.2 KiB, loaded 5,720 B = 5.6 KiB, stored 13,728 B = 13.4 KiB, 12 ms / 5 = 2.4 ms.
EXPECTED = [
    ("POOL", "16/28 blocks", "16.0 KiB of 28.0 KiB · 20 hits", "6 in use · 10 cached"),
    ("HOST", "9/36 blocks", "9.0 KiB of 36.0 KiB · 20 hits",
     "loaded 20.0 KiB · stored 40.0 KiB · 85 µs/load"),
    ("DISK", "4/10 blocks", "4.5 KiB of 11.2 KiB · 5 hits",
     "loaded 5.6 KiB · stored 13.4 KiB · 2.4 ms/load"),
]


def test_each_column_says_the_hand_computed_numbers():
    assert [row_texts(r) for r in tier_rows(COUNTERS)] == EXPECTED


def test_only_the_tiers_that_are_on_and_a_read_only_disk():
    host_only = {k: v for k, v in COUNTERS.items() if not k.startswith("kv_disk")}
    assert [r.name for r in tier_rows(host_only)] == ["pool", "host"]
    disk = tier_rows({**COUNTERS, "kv_disk_writable": 0.0})[2]
    assert row_texts(disk)[0] == "DISK read-only"
    # no loads yet: no mean load time
    idle = tier_rows({**COUNTERS, "kv_host_hits": 0.0, "kv_host_load_seconds": 0.0})[1]
    assert row_texts(idle)[3] == "loaded 20.0 KiB · stored 40.0 KiB"
    # an engine without kv_host_bytes_used: held blocks times the block size from the capacity
    old = {k: v for k, v in COUNTERS.items() if k != "kv_host_bytes_used"}
    assert tier_rows(old)[1].held_bytes == 9 * KIB


def test_no_lower_tier_no_columns():
    pool_only = {k: v for k, v in COUNTERS.items() if not k.startswith(("kv_host", "kv_disk"))}
    assert tier_rows(pool_only) == [] and tier_rows({}) == []


def test_short_seconds():
    assert [short_seconds(s) for s in (85e-6, 2.4e-3, 0.34, 2.5)] == [
        "85 µs", "2.4 ms", "340 ms", "2.5 s"]


def _frame(counters: dict[str, float]) -> Frame:
    n = int(counters.get("num_blocks_total", 1))
    zeros = np.zeros(n, np.int32)
    return Frame(time=0.0, state=np.zeros(n, np.uint8), ref_count=zeros, filled=zeros,
                 short_hash=zeros.astype(np.uint32), parent=zeros - 1, requests=[],
                 counters=counters, config={})  # fmt: skip


def test_the_panel_shows_hides_and_repaints_only_on_change(qtbot):
    window = QWidget()  # shown, as the main window is: the panel shows itself when it has data
    qtbot.addWidget(window)
    panel = TierPanel()
    QVBoxLayout(window).addWidget(panel)
    window.resize(900, 200)
    window.show()
    assert panel.isHidden()  # nothing yet
    painted: list[int] = []
    panel.update = lambda: painted.append(1)  # type: ignore[method-assign]
    first = _frame(COUNTERS)
    panel.show_frame(first)
    assert not panel.isHidden() and panel.texts == EXPECTED and len(painted) == 1
    panel.show_frame(first)  # the same frame on the next tick: nothing to do
    panel.show_frame(_frame(dict(COUNTERS)))  # a new frame, the same numbers: no repaint
    assert len(painted) == 1
    panel.show_frame(_frame({**COUNTERS, "kv_host_hits": 21.0}))
    assert len(painted) == 2 and panel.texts[1][2] == "9.0 KiB of 36.0 KiB · 21 hits"
    # the engine restarted without tiers, then none at all
    panel.show_frame(_frame({k: v for k, v in COUNTERS.items()
                             if not k.startswith(("kv_host", "kv_disk"))}))  # fmt: skip
    assert panel.isHidden() and panel.texts == []
    panel.show_frame(_frame(COUNTERS))
    assert not panel.isHidden()
    panel.show_frame(None)
    assert panel.isHidden()


def test_the_panel_paints(qtbot):
    panel = TierPanel()
    qtbot.addWidget(panel)
    panel.resize(900, panel.height())
    panel.show_counters(COUNTERS)
    image = panel.grab().toImage()
    assert image.width() == 900 and not image.isNull()
    # the pool's bar: in-use colour first, then the cached colour, then empty
    y = 6 + 15 + 1 + 4  # padding, the name line, a pixel, the middle of the 8-pixel bar
    col_width = (900 - 6) / 3 - 6
    colours = {image.pixelColor(int(6 + col_width * f), y).name() for f in (0.1, 0.3, 0.9)}
    assert colours == {"#4363d8", "#5f7a99", "#323642"}
