"""The KV block map: one cell per physical block, drawn by one ImageItem with a discrete LUT.

Cell colour = block state: empty, cached-evictable, in use (one colour per owning request), shared
(ref count > 1). A chat branch selected (an edit or a regenerate, `show_fork`) draws the blocks it
shares with the branch it was forked from in white: its prefix-cache hit, block by block. The
request table lists live requests with their origin (the client that sent
them: gui, load, http, ...). Selecting a request dims every block it does not hold and lists its
block table (logical -> physical). Hovering a cell shows block id, state, ref count, owners with
their origin, filled slots and the short prefix hash. Speculative decoding's last step, for one
frame (ui/kv/spec_marks.py): blocks that held drafts get a hatched outline, those whose rejected
drafts were rolled back a red cross, and the detail pane shows the selected request's slots.
"""

from __future__ import annotations

import math

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QPointF, Qt, Signal
from PySide6.QtGui import QCursor
from PySide6.QtWidgets import (
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QSplitter,
    QToolTip,
    QVBoxLayout,
    QWidget,
)

from ui import theme
from ui.kv.block_detail import STATE_NAMES, detail_text, state_name
from ui.kv.request_table import RequestTable
from ui.kv.spec_marks import SpecMarks, SpecOverlay, spec_marks, spec_tooltip
from ui.spec_history import DRAFT_TOKENS
from ui.telemetry import BLOCK_CACHED, BLOCK_EMPTY, BLOCK_IN_USE, Frame, origin_label

# colour indices in the LUT
GAP, EMPTY, CACHED, SHARED, REQ0 = 0, 1, 2, 3, 4
NREQ = len(theme.REQUEST_COLOURS)
FORK = REQ0 + NREQ
DIM = 32  # index + DIM = the same colour, dimmed (not part of the selection)
LUT_SIZE = 64
CELL, PITCH = 6, 7  # pixels per cell, and per cell plus its gap (pools up to 4096 blocks)


def cell_size(n: int) -> tuple[int, int]:
    """(cell, pitch) in image pixels: big pools get smaller cells so a redraw stays cheap."""
    if n <= 4096:
        return CELL, PITCH
    if n <= 65536:
        return 2, 3
    return 1, 1  # no gap: one pixel per block


def _lut() -> np.ndarray:
    base = [theme.BG, theme.EMPTY, theme.CACHED, theme.SHARED, *theme.REQUEST_COLOURS,
            theme.FORK]
    assert len(base) <= DIM
    lut = np.zeros((LUT_SIZE, 4), np.uint8)
    lut[:, 3] = 255
    bg = np.array(theme.hex_rgb(theme.BG), float)
    for i, h in enumerate(base):
        rgb = np.array(theme.hex_rgb(h), float)
        lut[i, :3] = rgb
        lut[i + DIM, :3] = (0.25 * rgb + 0.75 * bg).astype(np.uint8)
    lut[DIM + GAP, :3] = bg
    return lut


def grid_shape(n: int, aspect: float = 1.8) -> tuple[int, int]:
    """(rows, cols) for n cells, about `aspect` times wider than tall."""
    if n <= 0:
        return 1, 1
    cols = max(1, math.ceil(math.sqrt(n * aspect)))
    return math.ceil(n / cols), cols


class BlockMapWidget(QWidget):
    request_selected = Signal(str)  # a request id, "" for none

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.frame: Frame | None = None
        self.vocab_size = 0  # the model's, for the grammar's allowed-token counts
        self.colour_index = np.zeros(0, np.uint8)  # per block, before dimming (for tests)
        self.highlight_rid: str | None = None
        self.highlight_blocks: set[int] = set()
        self.remembered: dict[str, tuple[list[int], list[int]]] = {}
        self.forks: dict[str, str] = {}  # a chat branch's request -> the one it forked from
        self.fork_blocks: set[int] = set()  # of the highlighted request, shared with its source
        self._hit_blocks: dict[str, list[int]] = {}  # a fork's request -> its prefix-hit blocks
        self._slots: dict[str, int] = {}  # request id -> palette slot
        self._owners: dict[int, list[str]] = {}
        self._shape = (1, 1)
        self.cell, self.pitch = CELL, PITCH
        self._dirty = False

        self.view = pg.GraphicsLayoutWidget()
        self.view.setMinimumSize(260, 160)
        self.vb = self.view.addViewBox(lockAspect=True, invertY=True, enableMouse=False)
        self.vb.setMenuEnabled(False)
        self.image = pg.ImageItem(axisOrder="row-major")
        self.image.setLookupTable(_lut())
        self.vb.addItem(self.image)
        self.spec = SpecOverlay(self.vb)
        self.spec_marks = SpecMarks()  # of the frame drawn
        self.view.scene().sigMouseMoved.connect(self._on_mouse_moved)
        self.view.scene().sigMouseClicked.connect(self._on_mouse_clicked)

        self.legend = QLabel()
        self.legend.setTextFormat(Qt.TextFormat.RichText)
        self.legend.setWordWrap(True)
        self.legend.setToolTip(
            "speculative decoding, the last step since the previous frame: drafted = blocks it "
            "wrote draft tokens' K/V to (hatched outline); rolled back = blocks holding drafts "
            "the model rejected, whose K/V was forgotten (red cross). Select a request to see "
            "its slots.")

        self.table = RequestTable()
        self.table.itemSelectionChanged.connect(self._on_table_selection)

        self.block_table = QPlainTextEdit()
        self.block_table.setReadOnly(True)
        self.block_table.setFont(theme.mono_font(9))
        self.block_table.setLineWrapMode(QPlainTextEdit.LineWrapMode.NoWrap)
        self.block_table.setPlaceholderText("Select a request or conversation to see its block "
                                            "table (logical → physical).")

        side = QSplitter(Qt.Orientation.Vertical)
        side.addWidget(self.table)
        side.addWidget(self.block_table)
        side.setSizes([200, 120])
        split = QSplitter(Qt.Orientation.Horizontal)
        left = QWidget()
        ll = QVBoxLayout(left)
        ll.setContentsMargins(0, 0, 0, 0)
        ll.addWidget(self.legend)
        ll.addWidget(self.view, 1)
        split.addWidget(left)
        split.addWidget(side)
        split.setStretchFactor(0, 3)
        split.setStretchFactor(1, 2)
        split.setSizes([560, 380])
        lay = QHBoxLayout(self)
        lay.setContentsMargins(2, 2, 2, 2)
        lay.addWidget(split)
        self._set_legend({})

    # --- data in ----------------------------------------------------------------------------
    def set_frame(self, frame: Frame, remembered: dict | None = None) -> None:
        """Store the latest frame; drawing happens in `redraw` (called from the GUI timer)."""
        self.frame = frame
        self.note_frame(frame)
        if remembered is not None:
            self.remembered = remembered
        self._dirty = True

    def note_frame(self, frame: Frame) -> None:
        """A branch's prefix-cache hit, block by block, from a frame that shows its request
        live: the first cached_tokens / block_size blocks of its table hold the history it
        shares with the branch it forked from (the same prefix hashes, so the same physical
        blocks). Frames come in batches and only the last is drawn, so every one is noted: a
        short reply may be live in an earlier frame only, and a finished request's frame no
        longer says how much it hit."""
        if not self.forks or not frame.block_size:
            return
        for r in frame.requests:
            if r.request_id in self.forks and r.num_cached_tokens:
                self._hit_blocks[r.request_id] = r.block_table[
                    : r.num_cached_tokens // frame.block_size
                ]

    def highlight_request(self, rid: str | None) -> None:
        self.highlight_rid = rid or None
        self._dirty = True
        self.redraw()

    def show_fork(self, rid: str, source_rid: str) -> None:
        """Select a branch's request, marking the blocks it shares with `source_rid`'s."""
        self.forks[rid] = source_rid
        self.highlight_request(rid)

    def clear(self) -> None:
        self.frame = None
        self.image.clear()
        self.spec.clear()
        self.table.reset()
        self.block_table.clear()

    # --- drawing ----------------------------------------------------------------------------
    def redraw(self, force: bool = False) -> None:
        if not (self._dirty or force) or self.frame is None:
            return
        self._dirty = False
        f = self.frame
        self._owners = f.owners()
        self._assign_slots(f)
        cached = f.state == BLOCK_CACHED
        in_use = f.state == BLOCK_IN_USE
        shared = in_use & (f.ref_count > 1)
        idx = np.full(f.num_blocks, EMPTY, np.uint8)
        idx[cached] = CACHED
        for b, rids in self._owners.items():
            if 0 <= b < f.num_blocks:
                idx[b] = REQ0 + self._slots.get(rids[0], 0)
        idx[shared] = SHARED
        self.colour_index = idx
        self.highlight_blocks = self._blocks_of(f, self.highlight_rid)
        self.fork_blocks = self._shared_with_source(self.highlight_rid)
        shown = idx.copy()
        if self.highlight_rid is not None:
            mask = np.ones(f.num_blocks, bool)
            hb = [b for b in self.highlight_blocks if 0 <= b < f.num_blocks]
            mask[hb] = False
            shown[mask] += DIM
            shown[[b for b in self.fork_blocks if 0 <= b < f.num_blocks]] = FORK
        self.spec_marks = spec_marks(f)
        self._draw_cells(shown)
        self.spec.update(self.spec_marks, self._shape[1], self.cell, self.pitch, f.num_blocks)
        self._set_legend({
            "empty": int(np.count_nonzero(f.state == BLOCK_EMPTY)),
            "cached": int(np.count_nonzero(cached)),
            "in use": int(np.count_nonzero(in_use)),
            "shared": int(np.count_nonzero(shared)),
        })
        self.table.fill(f, self._slots, self.highlight_rid)
        self._fill_block_table(f)

    def _draw_cells(self, idx: np.ndarray) -> None:
        n = idx.shape[0]
        rows, cols = grid_shape(n, self._aspect())
        self.cell, self.pitch = cell_size(n)
        pitch = self.pitch
        if (rows, cols) != self._shape:
            self._shape = (rows, cols)
            self.vb.setRange(xRange=(0, cols * pitch), yRange=(0, rows * pitch), padding=0.02)
        grid = np.full(rows * cols, GAP, np.uint8)
        grid[:n] = idx
        grid = grid.reshape(rows, cols)
        img = np.full((rows, pitch, cols, pitch), GAP, np.uint8)
        img[:, : self.cell, :, : self.cell] = grid[:, None, :, None]
        self.image.setImage(img.reshape(rows * pitch, cols * pitch), autoLevels=False,
                            levels=(0, LUT_SIZE))

    def _aspect(self) -> float:
        w, h = self.view.width(), self.view.height()
        if w < 50 or h < 50:
            return 1.8
        return min(max(w / h, 0.5), 6.0)

    def resizeEvent(self, ev) -> None:  # noqa: N802 - Qt name
        super().resizeEvent(ev)
        self._dirty = True  # the grid follows the widget's shape

    def _assign_slots(self, f: Frame) -> None:
        live = [r.request_id for r in f.requests if r.status != "finished"]
        live_set = set(live)
        self._slots = {k: v for k, v in self._slots.items() if k in live_set}
        used = list(self._slots.values())
        for rid in live:
            if rid not in self._slots:
                slot = min(range(NREQ), key=lambda s: (used.count(s), s))
                self._slots[rid] = slot
                used.append(slot)

    def _shared_with_source(self, rid: str | None) -> set[int]:
        """The highlighted branch's hit blocks (note_frame) that it still holds."""
        if rid is None or rid not in self.forks:
            return set()
        return set(self._hit_blocks.get(rid, ())) & self.highlight_blocks

    def _blocks_of(self, f: Frame, rid: str | None) -> set[int]:
        if rid is None:
            return set()
        for r in f.requests:
            if r.request_id == rid:
                return set(r.live_blocks())
        # finished: its blocks that still hold the same prefix hash (cached, reusable)
        table, hashes = self.remembered.get(rid, ([], []))
        return {b for b, h in zip(table, hashes, strict=False)
                if h and 0 <= b < f.num_blocks and int(f.short_hash[b]) == h}

    def _set_legend(self, counts: dict[str, int]) -> None:
        items = [("empty", theme.EMPTY), ("cached", theme.CACHED),
                 ("in use", theme.REQUEST_COLOURS[2]), ("shared", theme.SHARED)]
        parts = []
        for name, col in items:
            n = counts.get(name)
            label = f"{name} {n}" if n is not None else name
            if name == "in use":
                sw = "".join(f'<span style="color:{c}">■</span>' for c in theme.REQUEST_COLOURS[:4])
            else:
                sw = f'<span style="color:{col}">■</span>'
            parts.append(f"{sw}&nbsp;{label}")
        if self.frame is not None and DRAFT_TOKENS in self.frame.counters:  # it speculates
            m = self.spec_marks
            # blocks the last speculative step drafted to / rolled back in (shown one frame)
            parts.append(f'<span style="color:{theme.SPEC_DRAFT}">▨</span>&nbsp;drafted '
                         f"{len(m.drafted)}")
            parts.append(f'<span style="color:{theme.SPEC_ROLLBACK}">✖</span>&nbsp;rolled back '
                         f"{len(m.rolled_back)}")
        if self.fork_blocks:
            parts.append(f'<span style="color:{theme.FORK}">■</span>&nbsp;shared with the '
                         f"branch it forked from {len(self.fork_blocks)}")
        bs = f" &nbsp;·&nbsp; block = {self.frame.block_size} tokens" if self.frame else ""
        self.legend.setText("&nbsp;&nbsp;&nbsp;".join(parts) + bs)

    def _fill_block_table(self, f: Frame) -> None:
        rid = self.highlight_rid
        if rid is None:
            self.block_table.clear()
            return
        live = next((r for r in f.requests if r.request_id == rid), None)
        remembered = self.remembered.get(rid, ([], []))[0]
        text = detail_text(f, rid, live, remembered, self.highlight_blocks, self.vocab_size)
        source = self.forks.get(rid)
        if source:
            n = len(self.fork_blocks)
            text += (f"\nbranch of {source}: {n} block{'s' if n != 1 else ''} "
                     f"({n * f.block_size} tokens) shared with it, drawn white")
        if text != self.block_table.toPlainText():
            self.block_table.setPlainText(text)

    # --- interaction --------------------------------------------------------------------------
    def block_at(self, scene_pos: QPointF) -> int | None:
        if self.frame is None:
            return None
        p = self.image.mapFromScene(scene_pos)
        x, y = p.x(), p.y()
        if x < 0 or y < 0:
            return None
        col, row = int(x // self.pitch), int(y // self.pitch)
        rows, cols = self._shape
        if col >= cols or row >= rows:
            return None
        b = row * cols + col
        return b if b < self.frame.num_blocks else None

    def tooltip_text(self, b: int) -> str:
        f = self.frame
        assert f is not None and 0 <= b < f.num_blocks
        state = state_name(f, b, STATE_NAMES)
        owners = self._owners.get(b, [])
        if owners:  # hover only: look the origins up here rather than on every redraw
            origins = {r.request_id: origin_label(r.origin, r.request_id) for r in f.requests
                       if r.request_id in owners}
            owners = [f"{rid} ({origins[rid]})" if rid in origins else rid for rid in owners]
        h = int(f.short_hash[b])
        return (f"block {b}\nstate: {state}\nref count: {int(f.ref_count[b])}\n"
                f"owners: {', '.join(owners) if owners else '—'}\n"
                f"filled: {int(f.filled[b])}/{f.block_size} slots\n"
                f"hash: {f'{h:08x}' if h else '—'}"
                + (f"\n{spec}" if (spec := spec_tooltip(f, b)) else ""))

    def _on_mouse_moved(self, pos: QPointF) -> None:
        b = self.block_at(pos)
        if b is None:
            QToolTip.hideText()
            return
        QToolTip.showText(QCursor.pos(), self.tooltip_text(b), self.view)

    def _on_mouse_clicked(self, ev) -> None:
        b = self.block_at(ev.scenePos())
        owners = self._owners.get(b, []) if b is not None else []
        rid = owners[0] if owners else ""
        self.highlight_request(rid or None)
        self.request_selected.emit(rid)

    def _on_table_selection(self) -> None:
        rows = self.table.selectionModel().selectedRows()
        rid = self.table.item(rows[0].row(), 0).text() if rows else ""
        self.highlight_request(rid or None)
        self.request_selected.emit(rid)
