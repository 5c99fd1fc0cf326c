"""Charts of a disaggregated deployment, one column per engine and one for the KV transfer
between them: throughput, running / waiting requests and the KV pool (% in use and cached) of
the prefill and of the decode engine; MB pulled per second, the mean time of one request's pull
and the pulls pending.

Each engine's column runs on that engine's clock (seconds since its first snapshot), the transfer
column on the decode engine's. Like ui/charts/engine.py, every plot item is created once and
`refresh` only calls `setData`; axes move in 5 s steps, titles change at most twice a second. """

from __future__ import annotations

import math
import time

import numpy as np
import pyqtgraph as pg
from PySide6.QtWidgets import QVBoxLayout, QWidget

from app.remote.kvscope_http import ROLES
from ui import theme
from ui.charts.engine import (
    TITLE_PERIOD_S,
    WINDOW_S,
    _fmt_rate,
    _nice,
    _opaque_brush,
    _pen,
    _pin_title_width,
)
from ui.disagg.panel import _mb, strip_values
from ui.disagg.telemetry import TransferHistory
from ui.telemetry import History

TRANSFER = "transfer"
COLUMNS = (*ROLES, TRANSFER)  # one refresh part each


class DisaggChartsWidget(QWidget):
    PARTS = len(COLUMNS)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.view = pg.GraphicsLayoutWidget()
        self.view.ci.setSpacing(4)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addWidget(self.view)
        self.plots: dict[str, pg.PlotItem] = {}  # "<column>.<chart>"
        self.titles: dict[str, str] = {}  # what each plot's title says now
        self.items: dict[str, pg.PlotDataItem] = {}
        self._seen = dict.fromkeys(COLUMNS, -1)
        self._xrange: dict[str, tuple[float, float]] = {}
        self._yranges: dict[str, tuple[float, float]] = {}
        self._last_titles = dict.fromkeys(COLUMNS, 0.0)
        for col, role in enumerate(ROLES):
            self._engine_column(col, role)
        self._transfer_column(len(ROLES))
        for col in range(len(COLUMNS)):
            self.view.ci.layout.setColumnStretchFactor(col, 1)

    def _engine_column(self, col: int, role: str) -> None:
        p = self._plot(f"{role}.tps", 0, col, f"{role} · throughput (tok/s)")
        self.items[f"{role}.ptps"] = p.plot(pen=_pen("prompt"))
        self.items[f"{role}.gtps"] = p.plot(pen=_pen("gen"))
        self._legend(p, (self.items[f"{role}.ptps"], "prompt"),
                     (self.items[f"{role}.gtps"], "generation"))
        p = self._plot(f"{role}.req", 1, col, f"{role} · requests")
        self.items[f"{role}.running"] = p.plot(pen=_pen("running"))
        self.items[f"{role}.waiting"] = p.plot(pen=_pen("waiting"))
        self._legend(p, (self.items[f"{role}.running"], "running"),
                     (self.items[f"{role}.waiting"], "waiting"))
        p = self._plot(f"{role}.kv", 2, col, f"{role} · KV cache (% of pool)")
        p.setYRange(0, 100, padding=0.02)
        self.items[f"{role}.kv_cached"] = p.plot(
            pen=pg.mkPen(theme.CACHED), fillLevel=0, fillBrush=_opaque_brush(theme.CACHED, 130))
        self.items[f"{role}.kv_in_use"] = p.plot(
            pen=_pen("in_use"), fillLevel=0,
            fillBrush=_opaque_brush(theme.SERIES["in_use"], 150))  # fmt: skip
        self._legend(p, (self.items[f"{role}.kv_in_use"], "in use"),
                     (self.items[f"{role}.kv_cached"], "cached"))

    def _transfer_column(self, col: int) -> None:
        p = self._plot("transfer.mb", 0, col, "KV pulled (MB/s)")
        self.items["transfer.mb"] = p.plot(pen=_pen("in_use"), connect="finite")
        p = self._plot("transfer.ms", 1, col, "transfer time per request (ms)")
        self.items["transfer.ms"] = p.plot(pen=_pen("ttft"), connect="finite")
        p = self._plot("transfer.pending", 2, col, "pulls pending")
        self.items["transfer.pending"] = p.plot(pen=_pen("waiting"))

    def _plot(self, key: str, row: int, col: int, title: str) -> pg.PlotItem:
        p = self.view.addPlot(row=row, col=col)
        p.setTitle(title, size="9pt")
        _pin_title_width(p)
        p.setMenuEnabled(False)
        p.setMouseEnabled(x=False, y=False)
        p.hideButtons()
        p.getAxis("bottom").setStyle(tickLength=-4)
        p.getAxis("left").setWidth(42)
        p.setDownsampling(auto=True, mode="peak")
        p.setClipToView(True)
        p.setXRange(0, WINDOW_S / 6, padding=0)
        p.setYRange(0, 1, padding=0.02)
        self.plots[key] = p
        self.titles[key] = title
        return p

    def _legend(self, p: pg.PlotItem, *items: tuple[object, str]) -> None:
        leg = p.addLegend(offset=(4, 2), labelTextSize="8pt", verSpacing=-6, colCount=len(items))
        leg.setBrush(pg.mkBrush(27, 29, 35, 170))
        for item, name in items:
            leg.addItem(item, name)

    def clear(self, column: str | None = None) -> None:
        for name in (column,) if column else COLUMNS:
            for key, item in self.items.items():
                if key.startswith(name + "."):
                    item.setData([], [])
            self._seen[name] = -1
            self._xrange.pop(name, None)

    # --- refresh ---------------------------------------------------------------------------
    def refresh(self, histories: dict[str, History], transfer: TransferHistory,
                part: int | None = None, force_titles: bool = False) -> None:
        """Column `part` (0 prefill, 1 decode, 2 transfer), or all of them; a column whose
        history has nothing new is left alone."""
        for i in range(self.PARTS) if part is None else (part,):
            name = COLUMNS[i]
            rows = transfer.rows if name == TRANSFER else histories[name].frames
            if rows.n == 0 or (rows.n == self._seen[name] and not force_titles):
                continue
            self._seen[name] = rows.n
            now = time.monotonic()
            titles = force_titles or now - self._last_titles[name] >= TITLE_PERIOD_S
            if titles:
                self._last_titles[name] = now
            if name == TRANSFER:
                self._refresh_transfer(transfer, titles)
            else:
                self._refresh_engine(name, histories[name], titles)

    def _window(self, column: str, t: np.ndarray) -> np.ndarray:
        """Rows in the shown 60 s; the x axis moves in 5 s steps."""
        x1 = max(WINDOW_S / 6, math.ceil(float(t[-1]) / 5.0) * 5.0)
        x0 = max(0.0, x1 - WINDOW_S)
        if self._xrange.get(column) != (x0, x1):
            self._xrange[column] = (x0, x1)
            for key, p in self.plots.items():
                if key.startswith(column + "."):
                    p.setXRange(x0, x1, padding=0)
        return t >= x0

    def _refresh_engine(self, role: str, h: History, titles: bool) -> None:
        fr = h.frames.view()
        fr = fr[self._window(role, fr[:, History.T])]
        t = fr[:, History.T]
        it = self.items
        it[f"{role}.ptps"].setData(t, fr[:, History.PTPS])
        it[f"{role}.gtps"].setData(t, fr[:, History.GTPS])
        self._y(f"{role}.tps", _nice(float(np.nanmax(fr[:, [History.PTPS, History.GTPS]]))))
        it[f"{role}.running"].setData(t, fr[:, History.RUNNING])
        it[f"{role}.waiting"].setData(t, fr[:, History.WAITING])
        self._y(f"{role}.req", _nice(float(fr[:, [History.RUNNING, History.WAITING]].max())))
        in_use = fr[:, History.IN_USE] * 100
        it[f"{role}.kv_in_use"].setData(t, in_use)
        it[f"{role}.kv_cached"].setData(t, in_use + fr[:, History.CACHED] * 100)
        if titles:
            r, last = h.rates, fr[-1]
            self._title(f"{role}.tps", f"{role} · tok/s: prompt {_fmt_rate(r.prompt_tps)} · "
                                       f"generation {_fmt_rate(r.gen_tps)}")
            self._title(f"{role}.req", f"{role} · requests: running "
                                       f"{last[History.RUNNING]:.0f} · waiting "
                                       f"{last[History.WAITING]:.0f}")
            self._title(f"{role}.kv", f"{role} · KV % of pool: in use "
                                      f"{last[History.IN_USE] * 100:.0f} · cached "
                                      f"{last[History.CACHED] * 100:.0f}")

    def _refresh_transfer(self, h: TransferHistory, titles: bool) -> None:
        rows = h.rows.view()
        rows = rows[self._window(TRANSFER, rows[:, h.T])]
        t = rows[:, h.T]
        self.items["transfer.mb"].setData(t, rows[:, h.MB_PS])
        self._y("transfer.mb", _nice_small(_finite_max(rows[:, h.MB_PS])))
        self.items["transfer.ms"].setData(t, rows[:, h.PULL_MS])
        self._y("transfer.ms", _nice(_finite_max(rows[:, h.PULL_MS])))
        self.items["transfer.pending"].setData(t, rows[:, h.PENDING])
        self._y("transfer.pending", _nice(_finite_max(rows[:, h.PENDING])))
        if titles:
            r, shown = h.rates, strip_values(h.rates)
            self._title("transfer.mb", f"KV pulled: {_mb(r.mb_per_s)} MB/s · "
                                       f"{shown['blocks_per_s']} blocks/s")
            self._title("transfer.ms", f"transfer per request: {shown['pull_ms']} · all time "
                                       f"{shown['pull_ms_total']}")
            self._title("transfer.pending", f"pulls pending {shown['pending']} · leases active "
                                            f"{shown['leases'].split(' · ')[0]}")

    def _y(self, key: str, hi: float) -> None:
        """A y range from 0, set only when it changes enough (grow at once, shrink at 1/3)."""
        cur = self._yranges.get(key)
        if cur is not None and hi <= cur[1] and hi > cur[1] / 3:
            return
        self._yranges[key] = (0.0, hi)
        self.plots[key].setYRange(0.0, hi, padding=0.02)

    def _title(self, key: str, text: str) -> None:
        if self.titles.get(key) != text:
            self.titles[key] = text
            self.plots[key].setTitle(text, size="9pt")


def _finite_max(a: np.ndarray) -> float:
    a = a[np.isfinite(a)]
    return float(a.max()) if a.size else 0.0


def _nice_small(v: float) -> float:
    """A 1-2-5 step at or above v, also below 1 (MB/s of a small model's blocks)."""
    if not math.isfinite(v) or v <= 0:
        return 1.0
    e = 10 ** math.floor(math.log10(v))
    return next(m * e for m in (1, 2, 5, 10) if v <= m * e)
