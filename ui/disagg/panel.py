"""The KV view of a disaggregated deployment: the prefill engine's pool and the decode engine's
pool side by side, each an ordinary block map (ui/kv/block_map.py) under a line naming the engine
and counting its blocks, and under both the transfer strip: blocks and MB pulled per second, the
mean time of one request's pull, pulls pending and failed, leases held and expired.

Blocks in use that no request holds are shown as one pseudo-request of their own: on the prefill
engine they are prompts kept under a lease until the decode engine pulls them, on the decode
engine blocks reserved for a pull in flight. Without it they would be drawn like empty blocks.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QFrame, QGridLayout, QLabel, QSplitter, QVBoxLayout, QWidget

from app.remote.kvscope_http import ROLES
from ui import theme
from ui.disagg.telemetry import TransferRates
from ui.kv.block_map import BlockMapWidget
from ui.telemetry import BLOCK_CACHED, BLOCK_EMPTY, BLOCK_IN_USE, Frame, RequestView

HELD = {"prefill": "leased to decode", "decode": "held for a pull"}  # the pseudo-request's id
HELD_ORIGIN = "kv transfer"
WARN = "#f5a623"


def with_held_blocks(f: Frame, role: str) -> Frame:
    """`f` with one more request holding the blocks in use that no live request holds."""
    owned = np.zeros(f.num_blocks, bool)
    for r in f.requests:
        if r.status != "finished" and r.block_table:
            table = np.asarray(r.block_table)
            owned[table[(table >= 0) & (table < f.num_blocks)]] = True
    held = np.flatnonzero((f.state == BLOCK_IN_USE) & ~owned)
    if not len(held):
        return f
    pseudo = RequestView(request_id=HELD[role], status="running",
                         block_table=held.tolist(), origin=HELD_ORIGIN)
    return dataclasses.replace(f, requests=[*f.requests, pseudo])


def pool_line(role: str, f: Frame | None, down: str) -> str:
    """The line above a pool: its engine, block counts, and why the engine is down (if so)."""
    head = f"<b>{role} engine</b>"
    if f is None:
        text = f"{head} · waiting for its telemetry"
    else:
        n = f.num_blocks
        in_use = int(np.count_nonzero(f.state == BLOCK_IN_USE))
        cached = int(np.count_nonzero(f.state == BLOCK_CACHED))
        empty = int(np.count_nonzero(f.state == BLOCK_EMPTY))
        held = next((len(r.block_table) for r in f.requests if r.origin == HELD_ORIGIN
                     and r.request_id == HELD[role]), 0)  # fmt: skip
        held_text = f" ({held:,} {HELD[role]})" if held else ""
        text = (f"{head} · pool {n:,} blocks × {f.block_size} tokens · {in_use:,} in use"
                f"{held_text} · {cached:,} cached · {empty:,} empty")
    if down:
        text += f' · <span style="color:{WARN}">down: {down}</span>'
    return text


class PoolView(QWidget):
    """One engine's pool: its line and its block map."""

    def __init__(self, role: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.role = role
        self.frame: Frame | None = None
        self.down = ""
        self.header = QLabel()
        self.header.setTextFormat(Qt.TextFormat.RichText)
        self.header.setStyleSheet(f"color: {theme.TEXT}; padding: 2px 4px;")
        self.header.setWordWrap(True)  # a long "down: why" must not widen the pool
        self.map = BlockMapWidget()
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.setSpacing(0)
        lay.addWidget(self.header)
        lay.addWidget(self.map, 1)
        # half the usual width per map: the cells get two thirds of it, the request table the rest
        inner = self.map.findChild(QSplitter, options=Qt.FindChildOption.FindDirectChildrenOnly)
        if inner is not None:
            inner.setSizes([320, 160])
        self._show_line()

    def set_frame(self, f: Frame, remembered: dict) -> None:
        self.frame = with_held_blocks(f, self.role)
        self.map.set_frame(self.frame, remembered)

    def set_down(self, why: str) -> None:
        self.down = why
        self._show_line()

    def redraw(self, force: bool = False) -> None:
        self.map.redraw(force)
        self._show_line()

    def clear(self) -> None:
        self.frame = None
        self.map.clear()
        self._show_line()

    def _show_line(self) -> None:
        text = pool_line(self.role, self.frame, self.down)
        if text != self.header.text():
            self.header.setText(text)


# the strip's cells: key, caption; the values come from `strip_values`
CELLS = (
    ("blocks_per_s", "pulled blocks/s"), ("mb_per_s", "pulled MB/s"),
    ("pull_ms", "transfer / request"), ("pull_ms_total", "… all time"),
    ("pulls", "pulls (all time)"), ("pending", "pulls pending"), ("failures", "failed pulls"),
    ("leases", "leases active · expired"), ("cached", "already cached"),
)  # fmt: skip
CELL_TIPS = {
    "blocks_per_s": "KV blocks the decode engine pulled from the prefill engine per second",
    "mb_per_s": "bytes pulled per second, in MB (10^6 bytes)",
    "pull_ms": "mean time of one request's pull (decode engine): pull seconds over pulls in "
               "the window (— when there was none)",
    "pull_ms_total": "mean time of one request's pull since the decode engine started",
    "pulls": "pulls done since the decode engine started (one per request handed over)",
    "pending": "pulls in flight now (their requests wait for their blocks)",
    "failures": "pulls that failed (recomputed, or the request failed): since start · in the "
                "window",
    "leases": "prompts the prefill engine holds for a pull now · leases that expired unpulled",
    "cached": "prompt blocks the decode pool already had: never pulled",
}


def _num(v: float) -> str:
    return "—" if not math.isfinite(v) else f"{v:,.0f}" if v >= 100 else f"{v:.1f}"


def _mb(v: float) -> str:
    if not math.isfinite(v):
        return "—"
    return f"{v:,.0f}" if v >= 100 else f"{v:.2f}" if v >= 1 else f"{v:.3f}"


def _ms(v: float) -> str:
    return "—" if not math.isfinite(v) else f"{_num(v)} ms"


def _count(v: float) -> str:
    return "—" if not math.isfinite(v) else f"{v:,.0f}"


def strip_values(r: TransferRates) -> dict[str, str]:
    """What each cell of the transfer strip says."""
    return {
        "blocks_per_s": _num(r.blocks_per_s),
        "mb_per_s": _mb(r.mb_per_s),
        "pull_ms": _ms(r.pull_ms),
        "pull_ms_total": _ms(r.pull_ms_total),
        "pulls": _count(r.pulls),
        "pending": _count(r.pending),
        "failures": f"{_count(r.failures)} · {_count(r.failures_window)} in {r.window_s:.0f} s",
        "leases": f"{_count(r.leases_active)} · {_count(r.leases_expired)}",
        "cached": f"{_count(r.already_cached)} blocks",
    }


class TransferStrip(QFrame):
    """A row of captioned numbers: the KV transfer between the two engines."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("transfer")
        self.setStyleSheet(f"QFrame#transfer {{ background: {theme.PANEL}; }}")
        grid = QGridLayout(self)
        grid.setContentsMargins(6, 2, 6, 2)
        grid.setHorizontalSpacing(14)
        grid.setVerticalSpacing(0)
        self.title = QLabel()
        self.title.setStyleSheet(f"color: {theme.TEXT}; font-weight: bold;")
        grid.addWidget(self.title, 0, 0, 2, 1)
        self.values: dict[str, QLabel] = {}
        for col, (key, caption) in enumerate(CELLS, start=1):
            cap = QLabel(caption)
            cap.setStyleSheet(f"color: {theme.MUTED}; font-size: 8pt;")
            value = QLabel("—")
            value.setStyleSheet(f"color: {theme.TEXT}; font-weight: bold;")
            for label in (cap, value):
                label.setToolTip(CELL_TIPS[key])
            grid.addWidget(cap, 0, col)
            grid.addWidget(value, 1, col)
            self.values[key] = value
        grid.setColumnStretch(len(CELLS) + 1, 1)
        self.show_rates(TransferRates())

    def show_rates(self, r: TransferRates) -> None:
        title = f"KV transfer prefill → decode\nlast {r.window_s:.0f} s"
        if self.title.text() != title:
            self.title.setText(title)
        for key, text in strip_values(r).items():
            label = self.values[key]
            if label.text() != text:  # a changed text re-lays the strip out
                label.setText(text)


class DisaggKvPanel(QWidget):
    """Both pools and the transfer strip."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.pools = {role: PoolView(role) for role in ROLES}
        split = QSplitter(Qt.Orientation.Horizontal)
        for role in ROLES:
            split.addWidget(self.pools[role])
        split.setSizes([480, 480])
        self.strip = TransferStrip()
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.setSpacing(2)
        lay.addWidget(split, 1)
        lay.addWidget(self.strip)

    @property
    def maps(self) -> dict[str, BlockMapWidget]:
        return {role: pool.map for role, pool in self.pools.items()}

    def clear(self, role: str | None = None) -> None:
        for r in (role,) if role else ROLES:
            self.pools[r].clear()
