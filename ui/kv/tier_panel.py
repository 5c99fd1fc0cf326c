"""The KV tiers strip under the block map: the pool and the tiers below it (host memory, disk), one
column each with a bar of what it holds and its numbers: blocks and bytes held of its capacity,
hits, bytes loaded back into the pool and stored down into the tier, and the mean time of a load.

Everything comes from the telemetry counters (engine_proc/kv_store/tiers.py counters(), the pool's
num_blocks_* and prefix-cache counters); the strip is hidden for engines without lower tiers.
It is one widget painted with QPainter: the numbers are recomputed from the latest frame on the
window's refresh timer, and the widget repaints only when a shown text or bar changes."""

from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtCore import QRectF, Qt
from PySide6.QtGui import QColor, QFont, QPainter, QPaintEvent
from PySide6.QtWidgets import QSizePolicy, QWidget

from ui import theme
from ui.telemetry import Frame
from ui.units import human_bytes

TIER_COLOURS = {"pool": theme.SERIES["in_use"], "host": "#3cb44b", "disk": "#f58231"}
_LINE, _BAR, _PAD = 15, 8, 6  # pixels: a text line, the bar, the margins
TOOLTIP = (
    "Where prefix KV blocks live. pool: the engine's KV cache (in use by requests, or cached: "
    "free but still holding a prefix); host and disk: the tiers below it (Engine → KV cache), "
    "which evicted prefixes are written down to.\n"
    "blocks and bytes held of the capacity · hits: prompt blocks found there (pool: at "
    "admission; a tier: blocks loaded back instead of recomputed) · loaded / stored: bytes "
    "copied up into the pool / down into the tier · the mean time of one block's load"
)


@dataclass(frozen=True, slots=True)
class TierRow:
    """One column's numbers (blocks are whole KV blocks of the pool's layout)."""

    name: str  # "pool" | "host" | "disk"
    held: float  # blocks holding data (pool: in use + cached)
    in_use: float  # pool: blocks referenced by requests; tiers: = held
    total: float  # capacity in blocks
    held_bytes: float
    total_bytes: float
    hits: float  # blocks
    bytes_loaded: float = 0.0
    bytes_stored: float = 0.0
    load_seconds: float = 0.0
    read_only: bool = False

    @property
    def mean_load_s(self) -> float | None:
        return self.load_seconds / self.hits if self.name != "pool" and self.hits else None


def has_tiers(c: dict[str, float]) -> bool:
    return "kv_host_blocks_total" in c or "kv_disk_blocks_total" in c


def tier_rows(c: dict[str, float]) -> list[TierRow]:
    """The pool and each lower tier the counters describe; [] without lower tiers."""
    if not has_tiers(c):
        return []
    total = c.get("num_blocks_total", 0.0)
    in_use, cached = c.get("num_blocks_in_use", 0.0), c.get("num_blocks_cached", 0.0)
    block_bytes = c.get("kv_pool_bytes", 0.0) / total if total else 0.0
    # Prompt tokens served at admission, less those the tiers loaded: found in the pool.
    pool_hit_tokens = c.get("prefix_cache_hits", 0.0) - c.get("external_prefix_cache_hits", 0.0)
    rows = [TierRow("pool", in_use + cached, in_use, total, (in_use + cached) * block_bytes,
                    c.get("kv_pool_bytes", 0.0),
                    max(pool_hit_tokens, 0.0) / (c.get("block_size") or 16))]  # fmt: skip
    for name in ("host", "disk"):
        cap = c.get(f"kv_{name}_blocks_total")
        if cap is None:
            continue
        held = c.get(f"kv_{name}_blocks", 0.0)
        total_bytes = c.get(f"kv_{name}_bytes_total", 0.0)
        # Host entries are whole blocks; an engine without the bytes-used counter gets them
        # from the capacity. Disk files also carry a header: the tier says what they take.
        used = c.get(f"kv_{name}_bytes_used", held * total_bytes / cap if cap else 0.0)
        rows.append(TierRow(
            name, held, held, cap, used, total_bytes, c.get(f"kv_{name}_hits", 0.0),
            c.get(f"kv_{name}_bytes_loaded", 0.0), c.get(f"kv_{name}_bytes_stored", 0.0),
            c.get(f"kv_{name}_load_seconds", 0.0),
            read_only=name == "disk" and not c.get("kv_disk_writable", 1.0)))  # fmt: skip
    return rows


def short_seconds(s: float) -> str:
    """'85 µs', '1.2 ms', '340 ms', '2.5 s'."""
    if s < 1e-3:
        return f"{s * 1e6:.0f} µs"
    if s < 0.1:
        return f"{s * 1e3:.1f} ms"
    if s < 1.0:
        return f"{s * 1e3:.0f} ms"
    return f"{s:.1f} s"


def row_texts(r: TierRow) -> tuple[str, str, str, str]:
    """(name, blocks, bytes and hits, movement): the four texts of a column."""
    name = r.name.upper() + (" read-only" if r.read_only else "")
    blocks = f"{r.held:,.0f}/{r.total:,.0f} blocks"
    size = f"{human_bytes(r.held_bytes)} of {human_bytes(r.total_bytes)} · {r.hits:,.0f} hits"
    if r.name == "pool":
        moved = f"{r.in_use:,.0f} in use · {r.held - r.in_use:,.0f} cached"
    else:
        mean = r.mean_load_s
        moved = (f"loaded {human_bytes(r.bytes_loaded)} · stored {human_bytes(r.bytes_stored)}"
                 + (f" · {short_seconds(mean)}/load" if mean is not None else ""))
    return name, blocks, size, moved


def _fraction(part: float, whole: float) -> float:
    return min(max(part / whole, 0.0), 1.0) if whole > 0 else 0.0


class TierPanel(QWidget):
    """A fixed-height strip: one column per tier (pool, host, disk)."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.rows: list[TierRow] = []
        self.texts: list[tuple[str, str, str, str]] = []  # what is drawn (tests read it)
        self._bars: list[tuple[float, float]] = []  # (in-use, held) fractions per column
        self.frame: Frame | None = None
        self.setFixedHeight(2 * _PAD + 3 * _LINE + _BAR + 4)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setToolTip(TOOLTIP)
        self._bold = QFont(self.font())
        self._bold.setBold(True)
        self._colours = {k: QColor(v) for k, v in TIER_COLOURS.items()}
        self._cached, self._empty = QColor(theme.CACHED), QColor(theme.EMPTY)
        self._text, self._muted = QColor(theme.TEXT), QColor(theme.MUTED)
        self._warn = QColor("#f5a623")
        self.setVisible(False)

    def show_frame(self, frame: Frame | None) -> None:
        """The latest telemetry frame (None: no engine); called on every refresh tick, it does
        nothing until another frame arrives."""
        if frame is self.frame:
            return
        self.frame = frame
        self.show_counters(frame.counters if frame is not None else {})

    def show_counters(self, counters: dict[str, float]) -> None:
        """The latest telemetry counters; repaints only what changed, hides without tiers."""
        rows = tier_rows(counters)
        texts = [row_texts(r) for r in rows]
        bars = [(_fraction(r.in_use, r.total), _fraction(r.held, r.total)) for r in rows]
        if texts != self.texts or bars != self._bars:
            self.rows, self.texts, self._bars = rows, texts, bars
            self.update()
        if self.isHidden() == bool(rows):
            self.setVisible(bool(rows))

    def paintEvent(self, ev: QPaintEvent) -> None:  # noqa: N802 - Qt name
        if not self.rows:
            return
        p = QPainter(self)
        p.fillRect(self.rect(), QColor(theme.BG))
        width = (self.width() - _PAD) / len(self.rows)
        for i, (row, texts, bar) in enumerate(zip(self.rows, self.texts, self._bars,
                                                  strict=True)):  # fmt: skip
            self._paint_column(p, QRectF(_PAD + i * width, _PAD, width - _PAD,
                                         self.height() - 2 * _PAD), row, texts, bar)  # fmt: skip
        p.end()

    def _paint_column(
        self, p: QPainter, r: QRectF, row: TierRow, texts: tuple[str, ...], bar: tuple[float, float]
    ) -> None:
        name, blocks, size, moved = texts
        colour = self._colours[row.name]
        left = Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter
        right = Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter
        p.setFont(self._bold)
        p.setPen(self._warn if row.read_only else colour)
        p.drawText(QRectF(r.x(), r.y(), r.width(), _LINE), left, name)
        p.setFont(self.font())
        p.setPen(self._text)
        p.drawText(QRectF(r.x(), r.y(), r.width(), _LINE), right, blocks)
        y = r.y() + _LINE + 1
        p.fillRect(QRectF(r.x(), y, r.width(), _BAR), self._empty)
        in_use, held = bar
        p.fillRect(QRectF(r.x(), y, r.width() * in_use, _BAR), colour)
        if held > in_use:  # the pool's cached blocks: free, but still a prefix to hit
            p.fillRect(QRectF(r.x() + r.width() * in_use, y, r.width() * (held - in_use), _BAR),
                       self._cached)  # fmt: skip
        y += _BAR + 2
        metrics = p.fontMetrics()
        for text, pen in ((size, self._text), (moved, self._muted)):
            p.setPen(pen)
            shown = metrics.elidedText(text, Qt.TextElideMode.ElideRight, int(r.width()))
            p.drawText(QRectF(r.x(), y, r.width(), _LINE), left, shown)
            y += _LINE
