"""Speculative decoding, watched: the share of drafts the target model confirmed per telemetry
interval over the charts' time window, and the drafts confirmed at each position of a draft since
the engine started (position 1 is confirmed most often: a draft's later tokens only count when
every one before them was right).

Below the engine charts (ui/charts/engine.py), hidden while the engine does not speculate (it
sends no spec_decode counters then). Like them, every item is created once and `refresh` only
sets data, at most when a new frame arrived."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtWidgets import QVBoxLayout, QWidget

from ui import theme
from ui.charts.style import _nice, _pct, _pin_title_width, _small_font
from ui.spec_history import SpecHistory

MAX_POSITIONS = 16  # bar labels made up front (vLLM's num_speculative_tokens rarely passes 8)
HEIGHT = 125
NO_DRAFTS = "no drafts yet"


class SpecChartsWidget(QWidget):
    def __init__(self, parent: QWidget | None = None, window_s: float = 10.0) -> None:
        super().__init__(parent)
        self.window_s = window_s  # the title's recent rate covers this many seconds
        self.view = pg.GraphicsLayoutWidget()
        self.view.ci.setSpacing(4)
        self.setFixedHeight(HEIGHT)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addWidget(self.view)
        self._seen: tuple[int, float] | None = None  # (points, speculative steps) last drawn
        self._xrange: tuple[float, float] | None = None
        self._titles: dict[int, str] = {}
        self._bar_max = 0.0

        p = self.view.addPlot(row=0, col=0)
        self._style(p)
        p.setYRange(0, 100, padding=0.02)
        # a line, no symbols: a scatter rebuilds a Python record per point on every setData,
        # and under steady speculation every frame adds a point (ui/charts/engine.py's Dots)
        self.rate = p.plot(pen=pg.mkPen(theme.SPEC_DRAFT))
        self.empty = pg.TextItem(NO_DRAFTS, anchor=(0.5, 0.5), color=theme.MUTED)
        p.addItem(self.empty, ignoreBounds=True)
        self.p_rate = p

        p = self.view.addPlot(row=0, col=1)
        self._style(p)
        p.getAxis("bottom").setStyle(tickFont=_small_font())
        self.bars = pg.BarGraphItem(x=[], height=[], width=0.7,
                                    brush=pg.mkBrush(theme.SPEC_DRAFT))  # fmt: skip
        p.addItem(self.bars)
        self.bar_labels = [pg.TextItem("", anchor=(0.5, 1.0), color=theme.TEXT)
                           for _ in range(MAX_POSITIONS)]  # fmt: skip
        for lab in self.bar_labels:
            p.addItem(lab)
        self.p_pos = p
        lay_ = self.view.ci.layout
        lay_.setColumnStretchFactor(0, 16)
        lay_.setColumnStretchFactor(1, 5)
        self.setVisible(False)
        self.clear()

    def _style(self, p: pg.PlotItem) -> None:
        p.setTitle(" ", size="9pt")
        _pin_title_width(p)
        p.setMenuEnabled(False)
        p.setMouseEnabled(x=False, y=False)
        p.hideButtons()
        p.getAxis("left").setWidth(42)
        p.getAxis("bottom").setStyle(tickLength=-4)

    def clear(self) -> None:
        self.rate.setData([], [])
        self.bars.setOpts(x=[], height=[])
        for lab in self.bar_labels:
            lab.setText("")
        self._seen, self._bar_max, self._xrange = None, 0.0, None
        self._title(self.p_rate, f"draft acceptance (%): {NO_DRAFTS}")
        self._title(self.p_pos, "accepted by position")
        self.empty.setVisible(True)

    def refresh(self, spec: SpecHistory, x_range: tuple[float, float] | None) -> None:
        """Show the widget while the engine speculates; draw when a frame moved the counters.
        `x_range`: the engine charts' time window (the rate shares their x axis)."""
        if self.isHidden() == spec.enabled:
            self.setVisible(spec.enabled)
        if not spec.enabled:
            return
        if x_range is not None and x_range != self._xrange:  # moves in steps, like the others
            self._xrange = x_range
            self.p_rate.setXRange(*x_range, padding=0)
            self.empty.setPos((x_range[0] + x_range[1]) / 2, 50)
        key = (spec.n, spec.num_drafts)
        if key == self._seen:
            return
        self._seen = key
        s = spec.series()
        if x_range is not None:
            s = s[s[:, 0] >= x_range[0]]
        self.rate.setData(s[:, 0], s[:, 1] * 100.0)
        self.empty.setVisible(spec.num_drafts == 0)
        self._draw_positions(spec)
        if spec.num_drafts == 0:
            self._title(self.p_rate, f"draft acceptance (%): {NO_DRAFTS}")
            return
        t_end = float(s[-1, 0]) if len(s) else 0.0
        recent = spec.rate_since(t_end - self.window_s)
        self._title(self.p_rate, f"draft acceptance: {_pct(recent)} last {self.window_s:.0f} s · "
                                 f"{_pct(spec.total_rate)} all time · "
                                 f"{spec.accepted_tokens:,.0f}/{spec.draft_tokens:,.0f} drafts")

    def _draw_positions(self, spec: SpecHistory) -> None:
        counts = spec.per_pos[:MAX_POSITIONS]
        x = np.arange(1, len(counts) + 1, dtype=float)
        self.bars.setOpts(x=x, height=counts)
        self.p_pos.getAxis("bottom").setTicks([[(float(i), f"{i:.0f}") for i in x], []])
        if len(counts):
            self.p_pos.setXRange(0.4, len(counts) + 0.6, padding=0)
        top = _nice(float(counts.max()) * 1.3) if len(counts) else 1.0
        if top != self._bar_max:
            self._bar_max = top
            self.p_pos.setYRange(0, top, padding=0)
        steps = spec.num_drafts
        for i, lab in enumerate(self.bar_labels):
            if i < len(counts) and steps:
                # of the speculative steps, the share that got this far
                lab.setText(f"{counts[i] / steps * 100:.0f}%")
                lab.setPos(i + 1, float(counts[i]))
            else:
                lab.setText("")
        self._title(self.p_pos, "accepted by position")

    def _title(self, p: pg.PlotItem, text: str) -> None:
        if self._titles.get(id(p)) != text:
            self._titles[id(p)] = text
            p.setTitle(text, size="9pt")

