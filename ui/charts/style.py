"""What the live charts share: pens and brushes in the theme's colours, titles that never
re-lay out the grid, and number formats. pyqtgraph only."""

from __future__ import annotations

import math

import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QGraphicsItem

from ui import theme


def _pen(key: str, width: float = 1.0, style: Qt.PenStyle = Qt.PenStyle.SolidLine) -> object:
    # The live charts keep width 1: Qt's raster engine strokes a wider pen as a path, which cost
    # ~10 ms per repaint of these charts (over 1,000 points a curve), in the GUI thread at 10 Hz.
    return pg.mkPen(theme.SERIES[key], width=width, style=style)


def _brush(key: str, alpha: int = 110) -> object:
    c = pg.mkColor(theme.SERIES[key])
    c.setAlpha(alpha)
    return pg.mkBrush(c)


def _opaque_brush(colour: str, alpha: int) -> object:
    """`colour` at `alpha` over the plot background, as an opaque brush: stacked areas are drawn
    as curves filled down to 0, each over the one below, so they must not show through."""
    c, bg = pg.mkColor(colour), pg.mkColor(theme.BG)
    a = alpha / 255.0
    mix = [round(b * (1 - a) + f * a) for b, f in zip(bg.getRgb()[:3], c.getRgb()[:3], strict=True)]
    return pg.mkBrush(*mix)


def _pin_title_width(p: pg.PlotItem) -> None:
    """Keep a title's text out of the layout. LabelItem.setText resets the label's size hints to
    the text's size: a long title would widen its column, and every changed number in a live
    title re-laid out the whole grid (plots resized, axes regenerated, a ~40 ms repaint of every
    chart, several times a second). Pinned, the label keeps one line's height and a nominal
    width whatever its text; the layout gives it the plot's width."""
    label = p.titleLabel
    height = label.itemRect().height()
    hints = {
        Qt.SizeHint.MinimumSize: (10.0, height),
        Qt.SizeHint.PreferredSize: (10.0, height),
        Qt.SizeHint.MaximumSize: (-1.0, -1.0),
        Qt.SizeHint.MinimumDescent: (0.0, 0.0),
    }

    def fixed_hints() -> None:  # stands in for LabelItem.updateMin
        label.setMinimumSize(10.0, height)
        label._sizeHint = dict(hints)

    label.updateMin = fixed_hints
    label.opts["justify"] = "left"  # a title longer than its plot loses its end, not both ends
    label.setFlag(QGraphicsItem.GraphicsItemFlag.ItemClipsChildrenToShape, True)
    fixed_hints()
    label.updateGeometry()


def _fmt_rate(v: float) -> str:
    return "—" if not math.isfinite(v) else (f"{v:,.0f}" if v >= 100 else f"{v:.1f}")


def _nice(v: float) -> float:
    """The next 1-2-5 step at or above v (at least 1), for stable axis ranges."""
    if not math.isfinite(v) or v <= 1:
        return 1.0
    e = 10 ** math.floor(math.log10(v))
    for m in (1, 2, 5, 10):
        if v <= m * e:
            return m * e
    return 10 * e


def _small_font():
    from PySide6.QtGui import QFont

    f = QFont()
    f.setPointSize(7)
    return f


def _pct(v: float) -> str:
    return "—" if not math.isfinite(v) else f"{v * 100:.0f}%"
