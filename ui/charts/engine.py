"""Live charts over the last minute of telemetry. Every plot item is created once; `refresh`
(called from the main window's timer at 10-30 Hz) only calls `setData` on them."""

from __future__ import annotations

import math
import time

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QVBoxLayout, QWidget

from ui import theme
from ui.charts.spec import SpecChartsWidget
from ui.charts.style import (
    _brush,
    _fmt_rate,
    _nice,
    _opaque_brush,
    _pct,
    _pen,
    _pin_title_width,
    _small_font,
)
from ui.telemetry import History

WINDOW_S = 60.0
MAX_POINTS = 1500  # per scatter, thinned evenly: enough to read, cheap to draw
TITLE_PERIOD_S = 0.5
LOG_TICKS = [(float(e), lab) for e, lab in enumerate(
    ("1", "10", "100", "1 s", "10 s", "100 s"))] + [(-1.0, "0.1"), (-2.0, "0.01")]


class Dots:
    """A scatter drawn as a curve of tiny segments with round caps. pyqtgraph's ScatterPlotItem
    builds a Python record per point on every setData (~5 ms for 1,500 points, at 10 Hz, in the
    GUI thread); a curve is a few numpy operations and one drawLines."""

    def __init__(self, plot: pg.PlotItem, colour: str, size: float) -> None:
        pen = pg.mkPen(colour, width=size)
        pen.setCapStyle(Qt.PenCapStyle.RoundCap)
        self.item = plot.plot(pen=pen, connect="pairs")
        self.item.setDownsampling(ds=1, auto=False)  # would break the pairs
        self.item.setClipToView(False)
        self.xData = np.empty(0)
        self.yData = np.empty(0)

    def setData(self, x: np.ndarray, y: np.ndarray) -> None:
        self.xData, self.yData = np.asarray(x, float), np.asarray(y, float)
        pairs_y = np.empty(2 * len(self.yData))
        pairs_y[0::2] = self.yData
        pairs_y[1::2] = self.yData + 1e-3  # sub-pixel: the round cap makes it a dot
        self.item.setData(np.repeat(self.xData, 2), pairs_y)


class ChartsWidget(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.view = pg.GraphicsLayoutWidget()
        self.view.ci.setSpacing(4)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addWidget(self.view)
        self.spec = SpecChartsWidget()  # below the grid; shown while the engine speculates
        lay.addWidget(self.spec)
        self.plots: list[pg.PlotItem] = []
        self.block_size = 16
        self._seen = [-1] * self.PARTS  # History.frames.n at each part's last refresh
        self._itl_seen = -1
        self._xrange: tuple[float, float] | None = None
        self._yranges: dict[int, tuple[float, float]] = {}
        self._title_text: dict[int, str] = {}
        self._last_titles = 0.0
        self._bars: list[float] = []

        # 1. per-token latency with TTFT marks (log scale: ITL ~ms, TTFT up to seconds)
        p = self._plot(0, 0, "per-token latency (ms)")
        # log10(ms) on a linear axis with our own labels: pyqtgraph's log-mode minor labels
        # pile up when the range spans several decades
        p.getAxis("left").setTicks([LOG_TICKS, []])
        p.setYRange(0, 2, padding=0.02)
        self.itl = Dots(p, theme.SERIES["itl"], 3)
        self.ttft = Dots(p, theme.SERIES["ttft"], 8)
        self._legend(p, (self.itl.item, "inter-token"), (self.ttft.item, "TTFT"))
        self.p_latency = p

        # 2. prefix cache: hit rate over a recent window
        p = self._plot(0, 1, "prefix-cache hit rate (%)", colspan=2)
        p.setYRange(0, 100, padding=0.02)
        self.hit = p.plot(pen=_pen("hit"))
        # the share of those hits loaded from the host / disk KV tiers (engines with tiers)
        self.tier_hit = p.plot(pen=_pen("cached", style=Qt.PenStyle.DashLine))
        self._legend(p, (self.hit, "all hits"), (self.tier_hit, "from host/disk tiers"))
        self.p_hit = p

        # 3. prompt tokens: cached vs computed (stacked, tok/s). Stacks are curves filled down
        # to 0, the upper one drawn first: pyqtgraph's FillBetweenItem rebuilds its path in Python
        # on every setData of either curve (~2 ms each, the charts' largest cost under load).
        p = self._plot(1, 0, "prompt tokens/s: cached vs computed")
        self.cached_top = p.plot(pen=_pen("cached"), fillLevel=0,
                                 fillBrush=_opaque_brush(theme.SERIES["cached"], 120))
        self.computed = p.plot(pen=_pen("computed"), fillLevel=0,
                               fillBrush=_opaque_brush(theme.SERIES["computed"], 90))
        self._legend(p, (self.cached_top, "cached"), (self.computed, "computed"))
        self.p_prompt = p

        # 4. throughput
        p = self._plot(1, 1, "throughput (tok/s)", colspan=2)
        self.ptps = p.plot(pen=_pen("prompt"))
        self.gtps = p.plot(pen=_pen("gen"))
        self._legend(p, (self.ptps, "prompt"), (self.gtps, "generation"))
        self.p_tps = p

        # 5. running / waiting
        p = self._plot(2, 0, "requests")
        self.running = p.plot(pen=_pen("running"), stepMode=None)
        self.waiting = p.plot(pen=_pen("waiting"))
        self._legend(p, (self.running, "running"), (self.waiting, "waiting"))
        self.p_req = p

        # 6. KV usage (% of the pool): in use / cached / empty stacked, and token occupancy
        p = self._plot(2, 1, "KV cache (% of pool)")
        p.setYRange(0, 100, padding=0.02)
        self.kv_full = p.plot(pen=pg.mkPen(theme.EMPTY), fillLevel=0,
                              fillBrush=pg.mkBrush(theme.EMPTY))
        self.kv_cached_top = p.plot(pen=pg.mkPen(theme.CACHED), fillLevel=0,
                                    fillBrush=_opaque_brush(theme.CACHED, 130))
        self.kv_in_use = p.plot(pen=_pen("in_use"), fillLevel=0,
                                fillBrush=_opaque_brush(theme.SERIES["in_use"], 150))
        self.occ = p.plot(pen=_pen("occupancy"))
        self._legend(p, (self.kv_in_use, "in use"), (self.kv_cached_top, "cached"),
                     (self.occ, "token occupancy"))
        self.p_kv = p

        # 7. next to it, now: paged KV bytes vs what contiguous per-request reservation would hold
        p = self.view.addPlot(row=2, col=2)
        p.setTitle("KV MiB now", size="9pt")
        p.setMenuEnabled(False)
        p.setMouseEnabled(x=False, y=False)
        p.hideButtons()
        p.getAxis("left").setWidth(34)
        p.getAxis("bottom").setTicks([[(0, "used"), (1, "filled"), (2, "contig")]])
        p.setXRange(-0.6, 2.6, padding=0)
        p.setYRange(0, 1, padding=0)
        self.bars = pg.BarGraphItem(x=[0, 1, 2], height=[0, 0, 0], width=0.7, brushes=[
            _brush("in_use", 220), _brush("occupancy", 220), _brush("contiguous", 220)])
        p.addItem(self.bars)
        self.bar_labels = [pg.TextItem("", anchor=(0.5, 1.0), color=theme.TEXT)
                           for _ in range(3)]
        for i, lab in enumerate(self.bar_labels):
            lab.setPos(i, 0)
            p.addItem(lab)
        self.p_bars = p
        lay = self.view.ci.layout
        lay.setColumnStretchFactor(0, 10)
        lay.setColumnStretchFactor(1, 6)
        lay.setColumnStretchFactor(2, 5)
        p.getAxis("bottom").setStyle(tickFont=_small_font())

    def _plot(self, row: int, col: int, title: str, colspan: int = 1) -> pg.PlotItem:
        p = self.view.addPlot(row=row, col=col, colspan=colspan)
        p.setTitle(title, size="9pt")
        _pin_title_width(p)
        # no grid: the axes draw grid lines through the whole plot on every repaint (slow)
        p.setMenuEnabled(False)
        p.setMouseEnabled(x=False, y=False)
        p.hideButtons()
        p.getAxis("bottom").setStyle(tickLength=-4)
        p.getAxis("left").setWidth(42)
        p.setDownsampling(auto=True, mode="peak")
        p.setClipToView(True)
        p.setXRange(0, WINDOW_S / 6, padding=0)  # sane empty axes until data arrives
        p.setYRange(0, 1, padding=0.02)
        self.plots.append(p)
        return p

    def _legend(self, p: pg.PlotItem, *items: tuple[object, str]) -> None:
        leg = p.addLegend(offset=(4, 2), labelTextSize="8pt", verSpacing=-6, colCount=len(items))
        leg.setBrush(pg.mkBrush(27, 29, 35, 170))
        for item, name in items:
            leg.addItem(item, name)

    def clear(self) -> None:
        for item in (self.itl, self.ttft, self.hit, self.tier_hit, self.computed, self.cached_top,
                     self.ptps, self.gtps, self.running, self.waiting, self.kv_in_use,
                     self.kv_cached_top, self.kv_full, self.occ):
            item.setData([], [])
        self.bars.setOpts(height=[0, 0, 0])
        for lab in self.bar_labels:
            lab.setText("")
        self.spec.clear()
        self._seen, self._itl_seen, self._xrange, self._bars = [-1] * self.PARTS, -1, None, []
        self._yranges.clear()

    PARTS = 2  # refresh(h, part) updates half of the plots: two short repaints, not one long

    def refresh(self, h: History, part: int | None = None) -> None:
        """Push the history into the plot items: `part` 0 (latency, hit rate, prompt tokens) or 1
        (throughput, requests, KV, bars, speculation, titles), or both. Each part repaints only
        its plots, so the GUI thread never spends one long event on all of them. Cheap when
        nothing changed: axes only move in whole steps and titles update at most twice a second
        (both force re-layout/re-render)."""
        if h.latest is None or len(h.frames) == 0:
            return
        for p in range(self.PARTS) if part is None else (part,):
            if self._seen[p] != h.frames.n:
                self._seen[p] = h.frames.n
                self._refresh_part(h, p)

    def _refresh_part(self, h: History, part: int) -> None:
        self.block_size = h.latest.block_size
        fr = h.frames.view()
        t = fr[:, History.T]
        t_end = float(t[-1])
        # the x window moves in 5 s steps, so the axes are not regenerated on every refresh
        x1 = max(WINDOW_S / 6, math.ceil(t_end / 5.0) * 5.0)
        x0 = max(0.0, x1 - WINDOW_S)
        keep = t >= x0
        fr, t = fr[keep], t[keep]
        if (x0, x1) != self._xrange:
            self._xrange = (x0, x1)
            for p in self.plots:
                p.setXRange(x0, x1, padding=0)  # the bar plot is not in self.plots
        itl = h.itl.view()
        itl = itl[itl[:, 0] >= x0]
        if len(itl) > MAX_POINTS:  # thin evenly so the whole window stays visible
            itl = itl[np.linspace(0, len(itl) - 1, MAX_POINTS).astype(np.int64)]
        tt = h.ttft.view()
        tt = tt[tt[:, 0] >= x0]
        if part == 0:
            self._refresh_latency_and_prompt(h, fr, t, itl, tt)
        else:
            self._refresh_load_and_kv(h, fr, t)
            self.spec.refresh(h.spec, self._xrange)
            now = time.monotonic()
            if now - self._last_titles >= TITLE_PERIOD_S:
                self._last_titles = now
                self._titles(h, fr, itl, tt)

    def _refresh_latency_and_prompt(
        self, h: History, fr: np.ndarray, t: np.ndarray, itl: np.ndarray, tt: np.ndarray
    ) -> None:
        if h.itl.n != self._itl_seen:
            self._itl_seen = h.itl.n
            self.itl.setData(itl[:, 0], _log_ms(itl[:, 1]))
        self.ttft.setData(tt[:, 0], _log_ms(tt[:, 1]))
        lat = np.concatenate((itl[:, 1], tt[:, 1])) * 1e3
        if len(lat):
            lo, hi = np.log10(max(float(lat.min()), 1e-2)), np.log10(max(float(lat.max()), 1e-2))
            self._y(self.p_latency, math.floor(lo), max(math.ceil(hi), math.floor(lo) + 1))

        hit = fr[:, History.HIT] * 100.0
        finite = np.isfinite(hit)
        self.hit.setData(t[finite], hit[finite])
        tier = fr[:, History.TIER_HIT] * 100.0
        finite = np.isfinite(tier)
        self.tier_hit.setData(t[finite], tier[finite])

        comp = fr[:, History.COMPUTED_TPS]
        top_prompt = comp + fr[:, History.CACHED_TPS]
        self.computed.setData(t, comp)
        self.cached_top.setData(t, top_prompt)
        self._y(self.p_prompt, 0.0, _nice(float(top_prompt.max()) if len(t) else 1.0))

    def _refresh_load_and_kv(self, h: History, fr: np.ndarray, t: np.ndarray) -> None:
        self.ptps.setData(t, fr[:, History.PTPS])
        self.gtps.setData(t, fr[:, History.GTPS])
        self._y(self.p_tps, 0.0, _nice(float(np.nanmax(fr[:, [History.PTPS, History.GTPS]]))))

        self.running.setData(t, fr[:, History.RUNNING])
        self.waiting.setData(t, fr[:, History.WAITING])
        self._y(self.p_req, 0.0, _nice(float(fr[:, [History.RUNNING, History.WAITING]].max())))

        in_use = fr[:, History.IN_USE] * 100
        cached = in_use + fr[:, History.CACHED] * 100
        self.kv_in_use.setData(t, in_use)
        self.kv_cached_top.setData(t, cached)
        self.kv_full.setData(t, np.full_like(t, 100.0))
        occ = fr[:, History.OCC] * 100
        ok = np.isfinite(occ)
        self.occ.setData(t[ok], occ[ok])
        self._refresh_bars(h)

    def _y(self, p: pg.PlotItem, lo: float, hi: float) -> None:
        """Set a y range only when it really changes (hysteresis: grow at once, shrink at 1/3)."""
        cur = self._yranges.get(id(p))
        if cur is not None:
            c_lo, c_hi = cur
            span = c_hi - c_lo
            if lo >= c_lo and hi <= c_hi and (hi - lo) > span / 3:
                return
        self._yranges[id(p)] = (lo, hi)
        p.setYRange(lo, hi, padding=0.02)

    def _title(self, p: pg.PlotItem, text: str) -> None:
        if self._title_text.get(id(p)) != text:
            self._title_text[id(p)] = text
            p.setTitle(text, size="9pt")

    def _titles(self, h: History, fr: np.ndarray, itl: np.ndarray, tt: np.ndarray) -> None:
        r = h.rates
        p50 = float(np.median(itl[-200:, 1])) * 1e3 if len(itl) else math.nan
        last_ttft = float(tt[-1, 1]) * 1e3 if len(tt) else math.nan
        self._title(self.p_latency, f"latency ms (log): ITL p50 {_fmt_rate(p50)} · last TTFT "
                                    f"{_fmt_rate(last_ttft)}")
        tiers = f" ({_pct(r.tier_hit_rate)} from tiers)" if math.isfinite(r.tier_hit_rate) else ""
        self._title(self.p_hit, f"prefix-cache hit rate: {_pct(r.hit_rate)}{tiers} last "
                                f"{h.window_s:.0f} s · {_pct(r.hit_rate_total)} all time · block "
                                f"{self.block_size} tokens")
        self._title(self.p_prompt, f"prompt tok/s: cached {_fmt_rate(r.cached_tps)} · computed "
                                   f"{_fmt_rate(r.computed_tps)}")
        self._title(self.p_tps, f"throughput tok/s: prompt {_fmt_rate(r.prompt_tps)} · "
                                f"generation {_fmt_rate(r.gen_tps)}")
        last = fr[-1]
        self._title(self.p_req, f"requests: running {last[History.RUNNING]:.0f} · waiting "
                                f"{last[History.WAITING]:.0f}")
        self._title(self.p_kv, f"KV % of pool: in use {last[History.IN_USE] * 100:.0f} · cached "
                               f"{last[History.CACHED] * 100:.0f} · empty "
                               f"{last[History.EMPTY] * 100:.0f} · occupancy "
                               f"{_pct(last[History.OCC])}")

    def _refresh_bars(self, h: History) -> None:
        assert h.latest is not None
        c = h.latest.counters
        used = c.get("kv_bytes_in_use", 0.0) / 2**20
        occ = c.get("kv_token_occupancy", math.nan)
        filled = used * occ if math.isfinite(occ) else 0.0
        contig = c.get("contiguous_kv_bytes", 0.0) / 2**20
        heights = [used, filled, contig]
        if heights == self._bars:
            return
        self._bars = heights
        self.bars.setOpts(height=heights)
        self._y(self.p_bars, 0.0, _nice(max(heights) * 1.3))
        for lab, v, x in zip(self.bar_labels, heights, range(3), strict=True):
            lab.setText(f"{v:,.0f}" if v >= 10 else f"{v:.1f}")
            lab.setPos(x, v)


def _log_ms(seconds: np.ndarray) -> np.ndarray:
    return np.log10(np.maximum(seconds * 1e3, 1e-2))
