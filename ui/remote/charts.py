"""Charts for a server watched through /metrics (vLLM, SGLang, llama.cpp's server): TTFT and
inter-token latency p50 / p90 / p99 over the recent window (from histogram bucket deltas), prefix
hit rate, preemptions, prompt and generation throughput, running / waiting, KV cache usage.

A metric the server does not export gets "not reported by this server" in its title and across
its plot, never a line at zero. Like ui/charts/engine.py, every plot item is created once and
`refresh` only calls `setData` (and changes a title only when its text changes). """

from __future__ import annotations

import math

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QVBoxLayout, QWidget

from app.remote.samples import MetricSample
from ui import theme
from ui.charts.engine import LOG_TICKS, WINDOW_S, _fmt_rate, _nice, _pct, _pen, _pin_title_width
from ui.remote.metrics_history import MetricsHistory

NOT_REPORTED = "not reported by this server"
H = MetricsHistory
# chart key -> the canonical metrics it needs (any one missing: that part is not reported)
NEEDS = {
    "ttft": ("ttft",), "itl": ("itl",), "hit": ("prefix_queries", "prefix_hits"),
    "preempt": ("preemptions",), "tps": ("prompt_tokens", "generation_tokens"),
    "requests": ("running", "waiting"), "kv": ("kv_usage",),
}  # fmt: skip


def _ms(v: float | None) -> str:
    return "—" if v is None or not math.isfinite(v) else _fmt_rate(v * 1e3)


def _quantiles(q: dict[float, float | None] | None) -> str:
    if not q or all(v is None for v in q.values()):
        return "— (none in the window)"
    return " · ".join(f"p{round(k * 100)} {_ms(v)}" for k, v in q.items())


def _num(v: float | None, missing: bool) -> str:
    if missing:
        return NOT_REPORTED
    return "—" if v is None else _fmt_rate(v) if v % 1 else f"{v:,.0f}"


class MetricsChartsWidget(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.view = pg.GraphicsLayoutWidget()
        self.view.ci.setSpacing(4)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addWidget(self.view)
        self.plots: dict[str, pg.PlotItem] = {}
        self.titles: dict[str, str] = {}  # what each plot's title says now
        self.notes: dict[str, pg.TextItem] = {}
        self._seen = -1
        self._xrange: tuple[float, float] | None = None
        self._yranges: dict[str, tuple[float, float]] = {}

        dash, dot = Qt.PenStyle.DashLine, Qt.PenStyle.DotLine
        p = self._plot("ttft", 0, 0, "TTFT ms (log)", log=True)
        self.ttft = [p.plot(pen=_pen("ttft", 2, style), connect="finite")
                     for style in (Qt.PenStyle.SolidLine, dash, dot)]
        self._legend(p, *zip(self.ttft, ("p50", "p90", "p99"), strict=True))
        p = self._plot("itl", 0, 1, "ITL: inter-token latency ms (log)", log=True)
        self.itl = [p.plot(pen=_pen("itl", 2, style), connect="finite")
                    for style in (Qt.PenStyle.SolidLine, dash, dot)]
        self._legend(p, *zip(self.itl, ("p50", "p90", "p99"), strict=True))
        p = self._plot("hit", 0, 2, "prefix-cache hit rate (%)")
        p.setYRange(0, 100, padding=0.02)
        self.hit = p.plot(pen=_pen("hit", 2), connect="finite")
        p = self._plot("tps", 1, 0, "throughput (tok/s)", colspan=2)
        self.ptps = p.plot(pen=_pen("prompt"), connect="finite")
        self.gtps = p.plot(pen=_pen("gen", 2), connect="finite")
        self._legend(p, (self.ptps, "prompt"), (self.gtps, "generation"))
        p = self._plot("preempt", 1, 2, "preemptions/s")
        self.preempt = p.plot(pen=_pen("waiting", 2), connect="finite")
        p = self._plot("requests", 2, 0, "requests")
        self.running = p.plot(pen=_pen("running", 2), connect="finite")
        self.waiting = p.plot(pen=_pen("waiting", 2), connect="finite")
        self._legend(p, (self.running, "running"), (self.waiting, "waiting"))
        p = self._plot("kv", 2, 1, "KV cache usage (%)", colspan=2)
        p.setYRange(0, 100, padding=0.02)
        self.kv = p.plot(pen=_pen("in_use", 2), connect="finite")
        lay = self.view.ci.layout
        for col in range(3):
            lay.setColumnStretchFactor(col, 1)
        self.items = [*self.ttft, *self.itl, self.hit, self.preempt, self.ptps, self.gtps,
                      self.running, self.waiting, self.kv]

    def _plot(self, key: str, row: int, col: int, title: str, colspan: int = 1,
              log: bool = False) -> pg.PlotItem:
        p = self.view.addPlot(row=row, col=col, colspan=colspan)
        p.setMenuEnabled(False)
        p.setMouseEnabled(x=False, y=False)
        p.hideButtons()
        p.getAxis("bottom").setStyle(tickLength=-4)
        p.getAxis("left").setWidth(42)
        p.setXRange(0, WINDOW_S / 6, padding=0)
        p.setYRange(0, 1, padding=0.02)
        if log:  # log10(ms) on a linear axis, labelled as in ui/charts/engine.py
            p.getAxis("left").setTicks([LOG_TICKS, []])
            p.setYRange(0, 2, padding=0.02)
        note = pg.TextItem(NOT_REPORTED, color=theme.MUTED, anchor=(0.5, 0.5))
        note.setVisible(False)
        p.addItem(note, ignoreBounds=True)
        self.plots[key], self.notes[key] = p, note
        self._title(key, title)
        return p

    def _legend(self, p: pg.PlotItem, *items: tuple[object, str]) -> None:
        leg = p.addLegend(offset=(4, 2), labelTextSize="8pt", verSpacing=-6, colCount=len(items))
        leg.setBrush(pg.mkBrush(27, 29, 35, 170))
        for item, name in items:
            leg.addItem(item, name)

    def _title(self, key: str, text: str) -> None:
        if self.titles.get(key) != text:
            self.titles[key] = text
            p = self.plots[key]
            p.setTitle(text, size="9pt")
            _pin_title_width(p)

    def clear(self) -> None:
        for item in self.items:
            item.setData([], [])
        self._seen, self._xrange = -1, None
        self._yranges.clear()

    def refresh(self, h: MetricsHistory) -> None:
        s = h.latest
        if s is None or h.n == self._seen:
            return
        self._seen = h.n
        rows = h.view()
        t = rows[:, H.T]
        x1 = max(WINDOW_S / 6, math.ceil(float(t[-1]) / 5.0) * 5.0)
        x0 = max(0.0, x1 - WINDOW_S)
        keep = t >= x0
        rows, t = rows[keep], t[keep]
        if (x0, x1) != self._xrange:
            self._xrange = (x0, x1)
            for p in self.plots.values():
                p.setXRange(x0, x1, padding=0)
        for items, first in ((self.ttft, H.TTFT50), (self.itl, H.ITL50)):
            for i, item in enumerate(items):
                ms = rows[:, first + i] * 1e3
                item.setData(t, np.log10(np.maximum(ms, 1e-2)))
        for key in ("ttft", "itl"):
            cols = (H.TTFT50, H.TTFT99) if key == "ttft" else (H.ITL50, H.ITL99)
            ms = rows[:, cols[0]:cols[1] + 1] * 1e3
            ms = ms[np.isfinite(ms)]
            if len(ms):
                lo = math.floor(np.log10(max(float(ms.min()), 1e-2)))
                hi = max(math.ceil(np.log10(max(float(ms.max()), 1e-2))), lo + 1)
                self._y(key, lo, hi)
        self.hit.setData(t, rows[:, H.HIT] * 100)
        self.preempt.setData(t, rows[:, H.PREEMPT])
        self._y("preempt", 0.0, _nice(_max(rows[:, H.PREEMPT])))
        self.ptps.setData(t, rows[:, H.PTPS])
        self.gtps.setData(t, rows[:, H.GTPS])
        self._y("tps", 0.0, _nice(_max(rows[:, [H.PTPS, H.GTPS]])))
        self.running.setData(t, rows[:, H.RUNNING])
        self.waiting.setData(t, rows[:, H.WAITING])
        self._y("requests", 0.0, _nice(_max(rows[:, [H.RUNNING, H.WAITING]])))
        self.kv.setData(t, rows[:, H.KV] * 100)
        self._show_titles(s)
        for key, needs in NEEDS.items():
            missing = all(n in s.missing for n in needs)
            note = self.notes[key]
            if missing != note.isVisible():
                note.setVisible(missing)
            if missing:
                (xa, xb), (ya, yb) = self.plots[key].viewRange()
                note.setPos((xa + xb) / 2, (ya + yb) / 2)

    def _y(self, key: str, lo: float, hi: float) -> None:
        cur = self._yranges.get(key)
        if cur is not None:
            c_lo, c_hi = cur
            if lo >= c_lo and hi <= c_hi and (hi - lo) > (c_hi - c_lo) / 3:
                return
        self._yranges[key] = (lo, hi)
        self.plots[key].setYRange(lo, hi, padding=0.02)

    def _show_titles(self, s: MetricSample) -> None:
        miss = set(s.missing)
        window = f" ({s.window_s:.0f} s)" if s.window_s else ""
        for key, name, q in (("ttft", "TTFT", s.ttft), ("itl", "ITL", s.itl)):
            if key in miss:
                self._title(key, f"{name}: {NOT_REPORTED}")
            else:
                self._title(key, f"{name} ms{window}: {_quantiles(q)}")
        if miss & {"prefix_queries", "prefix_hits"}:
            self._title("hit", f"prefix hit rate: {NOT_REPORTED}")
        else:
            self._title("hit", f"prefix hit rate{window}: {_pct(_nan(s.hit_rate))}")
        self._title("preempt", f"preemptions/s: {NOT_REPORTED}" if "preemptions" in miss
                    else f"preemptions/s: {_num(s.preemptions_per_s, False)}")
        if {"prompt_tokens", "generation_tokens"} <= miss:
            self._title("tps", f"throughput: {NOT_REPORTED}")
        else:
            self._title("tps", f"throughput tok/s: prompt "
                               f"{_num(s.prompt_tps, 'prompt_tokens' in miss)} · generation "
                               f"{_num(s.gen_tps, 'generation_tokens' in miss)}")
        self._title("requests", f"requests: running {_num(s.running, 'running' in miss)} · "
                                f"waiting {_num(s.waiting, 'waiting' in miss)}")
        if "kv_usage" in miss:
            self._title("kv", f"KV cache usage: {NOT_REPORTED}")
        else:
            ranks = sum(1 for r in s.ranks.values() if r.kv_usage is not None)
            mean = f" (mean of {ranks} ranks)" if ranks > 1 else ""
            self._title("kv", f"KV cache usage: {_pct(_nan(s.kv_usage))}{mean}")


def _nan(v: float | None) -> float:
    return math.nan if v is None else v


def _max(a: np.ndarray) -> float:
    a = a[np.isfinite(a)]
    return float(a.max()) if a.size else 1.0
