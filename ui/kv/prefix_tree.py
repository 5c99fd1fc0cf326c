"""The *Prefix tree* panel: the engine's prefix cache as a tree, rebuilt from its KV cache events
(ipc/kv_events.py) and laid out off the GUI thread (ui/kv/prefix_tree_layout.py).

An icicle: each cached block is a band `block_size` tokens wide at its token position, as tall as
the number of branches below it; a linear run is one long band. Colour by state (in use by a
request, cached and evictable, on the path of the selected request) from the telemetry frame;
a block evicted from the pool that a lower KV tier still holds is drawn in that tier's colour,
muted (host memory, or disk only), the tiers strip's hues. Hovering a band shows its tokens,
where it lives, pool block, owners, the hits this window saw and last use. Items are created
once; the redraw timer refills one small image, and does nothing when nothing changed.

The same panel draws a remote server's tree from its vLLM-format KV events
(ui/window/kv_events.py, `use_remote`): coloured by the fastest medium holding a block (GPU,
CPU memory, storage), with a hover the caller writes (the sources holding it, its text).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QRectF, Qt
from PySide6.QtWidgets import QHBoxLayout, QLabel, QToolTip, QVBoxLayout, QWidget

from ui import theme
from ui.kv.prefix_tree_layout import DISK_ONLY, HOST_ONLY, TreeLayout
from ui.kv.tier_panel import TIER_COLOURS
from ui.telemetry import BLOCK_IN_USE, Frame

CACHED_BAR, IN_USE_BAR, SELECTED_BAR, HOST_BAR, DISK_BAR, EMPTY_BAR = range(6)


def _muted(colour: str, share: float = 0.45) -> str:
    """`colour` blended into the plot background: quieter than the pool's live states."""
    fg, bg = pg.mkColor(colour), pg.mkColor(theme.BG)
    pairs = zip(fg.getRgb()[:3], bg.getRgb()[:3], strict=True)
    mix = [round(share * a + (1 - share) * b) for a, b in pairs]
    return "#{:02x}{:02x}{:02x}".format(*mix)


# legend text and colour per bar kind, in BAR_COLOURS order (EMPTY_BAR: transparent, unlisted)
BARS = [
    ("cached in the pool", theme.CACHED),
    ("in use by a request", theme.SERIES["in_use"]),
    ("the selected request", theme.SHARED),
    ("evicted, in host memory", _muted(TIER_COLOURS["host"])),
    ("evicted, on disk only", _muted(TIER_COLOURS["disk"])),
]
BAR_COLOURS = np.array([pg.mkColor(c).getRgb() for _, c in BARS] + [(0, 0, 0, 0)], np.uint8)
BAR_RGBA32 = BAR_COLOURS.view(np.uint32).ravel()  # the same bytes, one word per colour
# a remote tree's legend: the same colours, named by medium (no pool, no requests over events)
REMOTE_BARS = {CACHED_BAR: "on the GPU", HOST_BAR: "in CPU memory only",
               DISK_BAR: "on disk or storage only"}  # fmt: skip
WAITING = "waiting for KV cache events from the engine"
MEDIUM_NAMES = {"pool": "the pool", "host": "host memory", "disk": "disk"}
_MEDIUM_ORDER = {m: i for i, m in enumerate(MEDIUM_NAMES)}


class PrefixTreePanel(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.plot = pg.PlotWidget()
        self.plot.setMenuEnabled(False)
        self.plot.hideButtons()
        self.plot.invertY(True)  # row 0 at the top
        self.plot.getAxis("left").setStyle(showValues=False)
        self.plot.getAxis("left").setWidth(8)
        self.plot.setLabel("bottom", "token position")
        self.note = QLabel(WAITING)
        self.note.setStyleSheet(f"color: {theme.MUTED}; padding: 2px 6px;")
        self.legend = QLabel()
        self.legend.setTextFormat(Qt.TextFormat.RichText)
        self.legend.setStyleSheet(f"color: {theme.MUTED}; padding: 2px 6px;")
        # a remote tree's hover (layout, block index -> text); None: the engine's own
        self.describer: Callable[[TreeLayout, int], str] | None = None
        self.remote_bars = REMOTE_BARS  # a remote tree's colour names (the fleet's: holders)
        self._set_legend(tiers=False)
        top = QHBoxLayout()
        top.addWidget(self.note, 1)
        top.addWidget(self.legend)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.setSpacing(0)
        lay.addLayout(top)
        lay.addWidget(self.plot)
        # One image (two sub-rows per row, a column per block depth) refilled per redraw from
        # the layout's owner map: a numpy lookup instead of stroking 20,000 bars.
        self.image = pg.ImageItem(axisOrder="row-major")
        self.plot.addItem(self.image)
        self.kind = np.zeros(0, np.uint8)  # per block: CACHED_BAR, IN_USE_BAR or SELECTED_BAR
        self.layout_: TreeLayout | None = None
        self.frame: Frame | None = None
        self.highlight_rid: str | None = None
        self.hits = np.zeros(0, np.int64)  # per pool block, hits this window saw
        self.last_access = np.zeros(0, np.float64)  # per pool block, engine clock
        self._seen_requests: set[str] = set()
        self._dirty = False
        self.plot.scene().sigMouseMoved.connect(self._on_mouse_moved)

    # ------------------------------------------------------------------ inputs

    def use_remote(self, describer: Callable[[TreeLayout, int], str], waiting: str,
                   legend: dict[int, str] | None = None) -> None:  # fmt: skip
        """Draw a remote server's tree (its KV events in vLLM's format) from now on; `legend`
        renames the three colours (bar kind -> text) when they mean something else."""
        self.describer = describer
        self.remote_bars = legend or REMOTE_BARS
        self.clear(waiting)

    def use_engine(self) -> None:
        """Back to the engine's own tree."""
        if self.describer is not None:
            self.describer = None
            self.clear(WAITING)

    def clear(self, note: str) -> None:
        self.layout_ = None
        self.image.clear()
        self.note.setText(note)
        self._set_legend(tiers=False)

    def set_layout(self, layout: TreeLayout, in_sync: bool = True, note: str | None = None,
                   ) -> None:  # fmt: skip
        """`note`: what the caller says above the tree instead of the engine's counts."""
        self.layout_ = layout
        self._dirty = True
        host, disk = layout.count(HOST_ONLY), layout.count(DISK_ONLY)
        tiers = f" ({host:,} in host memory only, {disk:,} on disk only)" if host + disk else ""
        self.note.setText(note if note is not None else (
            f"{layout.num_blocks:,} cached blocks{tiers} · {layout.num_rows:,} branches · "
            f"{layout.num_roots:,} roots" + ("" if in_sync else " · events lost, replay requested")
            + sampled_note(layout)
        ))  # fmt: skip
        self._set_legend(tiers=bool(host + disk))

    def _set_legend(self, tiers: bool) -> None:
        """The colours' meanings; the tiers' only once the tree has blocks only they hold."""
        if self.describer is not None:
            kinds = (CACHED_BAR, HOST_BAR, DISK_BAR) if tiers else (CACHED_BAR,)
            self.legend.setText(" ".join(
                f'<span style="color:{BARS[k][1]}">■</span> {self.remote_bars[k]}' for k in kinds))
            return
        shown = BARS if tiers else BARS[:HOST_BAR]
        self.legend.setText(
            " ".join(f'<span style="color:{c}">■</span> {text}' for text, c in shown)
        )

    def set_frame(self, frame: Frame) -> None:
        """Block states and request tables for the colours; per-block hits and last access."""
        n = frame.num_blocks
        if self.hits.shape[0] != n:
            self.hits = np.zeros(n, np.int64)
            self.last_access = np.zeros(n, np.float64)
        self.last_access[frame.ref_count[:n] > 0] = frame.time
        bs = frame.block_size
        for r in frame.requests:
            if r.request_id in self._seen_requests or r.num_computed_tokens == 0:
                continue
            self._seen_requests.add(r.request_id)
            hit = [b for b in r.block_table[: r.num_cached_tokens // bs] if 0 <= b < n]
            self.hits[hit] += 1
        if len(self._seen_requests) > 50_000:
            self._seen_requests = {r.request_id for r in frame.requests}
        self.frame = frame
        self._dirty = True

    def highlight_request(self, rid: str | None) -> None:
        self.highlight_rid = rid
        self._dirty = True

    # ------------------------------------------------------------------ drawing

    def redraw(self, force: bool = False) -> None:
        if not (self._dirty or force) or self.layout_ is None:
            return
        self._dirty = False
        lay = self.layout_
        kind = np.full(lay.num_blocks, CACHED_BAR, np.uint8)
        kind[self._states(lay) == BLOCK_IN_USE] = IN_USE_BAR
        kind[lay.tier == HOST_ONLY] = HOST_BAR
        kind[lay.tier == DISK_ONLY] = DISK_BAR
        kind[self._selected(lay)] = SELECTED_BAR
        self.kind = kind
        # owner -1 (no block) -> EMPTY_BAR, a transparent colour; one 32-bit gather per cell
        # (not four bytes): a 100,000-block tree's image has millions of cells
        colour_of_owner = BAR_RGBA32[np.concatenate(([EMPTY_BAR], kind)).astype(np.intp)]
        rgba = colour_of_owner[lay.owner + 1].view(np.uint8).reshape(*lay.owner.shape, 4)
        self.image.setImage(rgba, autoLevels=False)
        rows2, cols = lay.owner.shape
        rows2 *= lay.row_step
        # sub-row k covers rows [k / 2 - 0.5, (k + 1) / 2 - 0.5); column c tokens [c bs, (c+1) bs)
        self.image.setRect(QRectF(0.0, -0.5, cols * lay.block_size, rows2 / 2))

    def _states(self, lay: TreeLayout) -> np.ndarray:
        out = np.zeros(lay.num_blocks, np.uint8)
        f = self.frame
        if f is None:
            return out
        ok = (lay.block_id >= 0) & (lay.block_id < f.num_blocks)
        out[ok] = f.state[lay.block_id[ok]]
        return out

    def _selected(self, lay: TreeLayout) -> np.ndarray:
        if self.highlight_rid is None or self.frame is None:
            return np.zeros(lay.num_blocks, bool)
        table = next(
            (r.block_table for r in self.frame.requests if r.request_id == self.highlight_rid), []
        )
        return np.isin(lay.block_id, np.asarray(table, np.int64))

    # ------------------------------------------------------------------ hover

    def _on_mouse_moved(self, pos) -> None:
        lay = self.layout_
        if lay is None or lay.num_blocks == 0:
            return
        p = self.plot.getPlotItem().vb.mapSceneToView(pos)
        i = self.bar_at(p.x(), p.y())
        if i is None:
            QToolTip.hideText()
            return
        QToolTip.showText(self.plot.mapToGlobal(self.plot.mapFromScene(pos)), self.describe(i))

    def bar_at(self, x: float, y: float) -> int | None:
        return None if self.layout_ is None else self.layout_.block_at(x, y)

    def describe(self, i: int) -> str:
        lay = self.layout_
        assert lay is not None
        if self.describer is not None:
            return self.describer(lay, i)
        block_id = int(lay.block_id[i])
        start = int(lay.x0[i])
        lines = [f"tokens {start}–{start + lay.block_size - 1} · hash {lay.hashes[i][:4].hex()}"]
        if i < len(lay.media) and lay.media[i] != {"pool"}:  # a lower tier holds it too
            lines.append(where_text(lay.media[i]))
        if 0 <= block_id < self.hits.shape[0]:
            lines.append(f"pool block {block_id} · hits seen {int(self.hits[block_id])}")
            if self.frame is not None and self.last_access[block_id] > 0:
                ago = self.frame.time - self.last_access[block_id]
                lines.append(f"last in use {ago:.1f} s ago")
        if self.frame is not None:
            owners = [r.request_id for r in self.frame.requests if block_id in r.block_table]
            if owners:
                lines.append("owners: " + ", ".join(o[:12] for o in owners[:6]))
        lines.append(f"token ids: {lay.tokens[i][:16]}")
        return "\n".join(lines)


def sampled_note(layout: TreeLayout) -> str:
    """Said when a huge tree is drawn with every n-th row only (prefix_tree_layout.MAX_CELLS)."""
    step = layout.row_step
    return f" · drawn at 1 row in {step} (too many to draw all)" if step > 1 else ""


def where_text(media: frozenset[str]) -> str:
    """Where a block lives, for the hover; a block only lower tiers hold says it was evicted."""
    ordered = sorted(media, key=lambda m: _MEDIUM_ORDER.get(m, len(_MEDIUM_ORDER)))
    names = ", ".join(MEDIUM_NAMES.get(m, m) for m in ordered)
    return ("" if "pool" in media else "evicted from the pool · ") + f"lives in: {names}"
