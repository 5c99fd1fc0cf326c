"""What the link delivers, into the main window's panels: chat replies and telemetry frames as
they arrive, chart and block-map redraws from a timer. Every handler's time goes into
`window.perf` (the latency benchmark, `python -m app --measure-latency`, reports it)."""

from __future__ import annotations

import collections
import time

from PySide6.QtCore import QObject, QTimer

from ui.telemetry import Frame
from ui.window.host import WindowHost

PHASES: tuple[int | str, ...] = (0, "map", 1)  # charts part 0, block map, charts part 1



class TelemetryFeed(QObject):
    """Slots for the link's `replies` and `frames` (a QObject, so that `sender()` tells the
    current link from a replaced one) and the redraw timer."""

    def __init__(self, window: WindowHost, refresh_hz: float) -> None:
        super().__init__(window)
        self.w = window
        self.frames_seen = 0
        # Half the charts, the block map, the other half of the charts, on successive ticks:
        # each panel at refresh_hz, and no single event repaints more than a third of the work
        # (the longest event is what a click waits for).
        self._tick = 0
        self.timer = QTimer(window)
        self.timer.setInterval(max(1, int(1000 / (len(PHASES) * refresh_hz))))
        self.timer.timeout.connect(self._refresh)

    def on_replies(self, msgs: list) -> None:
        t0 = time.perf_counter()
        msgs = self.w.token_counter.take_replies(msgs)  # Tokenized: the counter asked for them
        if msgs:
            self.w.chat.on_replies(msgs)
        self.w.perf["replies"].append(time.perf_counter() - t0)

    def on_frames(self, frames: list[Frame]) -> None:
        if self.sender() is not self.w.link:
            return
        t0 = time.perf_counter()
        self._take_frames(frames)
        self.w.perf["frames"].append(time.perf_counter() - t0)

    def on_prefix_tree(self, layout: object, in_sync: bool) -> None:
        if self.sender() is not self.w.link:
            return
        t0 = time.perf_counter()
        self.w.prefix_tree.set_layout(layout, in_sync)  # type: ignore[arg-type]
        self.w.perf.setdefault("prefix tree", collections.deque(maxlen=10_000)).append(
            time.perf_counter() - t0
        )

    def _take_frames(self, frames: list[Frame]) -> None:
        w = self.w
        for f in frames:
            w.history.add(f)
        self.frames_seen += len(frames)
        last = frames[-1]
        for f in frames[:-1]:  # a branch's hit may show in these alone (set_frame notes the last)
            w.block_map.note_frame(f)
        w.block_map.set_frame(last, w.history.last_tables)
        for f in frames:  # hits and last access count every frame
            w.prefix_tree.set_frame(f)
            w.expert_view.add(f)
        tab = w.kv_tabs.indexOf(w.expert_view)
        if w.kv_tabs.isTabVisible(tab) != w.expert_view.has_experts:
            w.kv_tabs.setTabVisible(tab, w.expert_view.has_experts)
        if w.want_highlight is not None:
            erid = w.remote.engine_rid(w.want_highlight)
            if erid is not None and erid != w.block_map.highlight_rid:
                w.block_map.highlight_rid = erid  # drawn with this frame
                w.prefix_tree.highlight_request(erid)
        w.controls.show_config(last.config)
        w.api_toggle.on_frame()
        if w.state in ("ready", "busy"):
            running = last.counters.get("num_requests_running", 0)
            waiting = last.counters.get("num_requests_waiting", 0)
            w.set_state("busy" if running or waiting else "ready",
                        f"{running:.0f} running, {waiting:.0f} waiting" if running or waiting
                        else "")

    def _refresh(self) -> None:
        w = self.w
        t0 = time.perf_counter()
        phase = PHASES[self._tick % len(PHASES)]
        self._tick += 1
        aggregate = w.kv_stack.currentWidget() is w.kv_aggregate
        # a server's /metrics charts, whether its KV area shows usage or its KV events' tree
        metric = w.chart_stack.currentWidget() is w.metric_charts
        if phase == "map":
            if aggregate:
                w.kv_aggregate.redraw()
            elif w.kv_tabs.currentWidget() is w.prefix_tree:
                w.prefix_tree.redraw()
            elif w.kv_tabs.currentWidget() is w.expert_view:
                w.expert_view.redraw()
            else:
                w.block_map.redraw()
        elif metric:
            w.metric_charts.refresh(w.metric_history)  # a no-op when no new scrape arrived
        else:
            w.charts.refresh(w.history, part=phase)
        w.perf["refresh"].append(time.perf_counter() - t0)

    def redraw_now(self) -> None:
        """Both panels at once (screenshots)."""
        w = self.w
        if w.chart_stack.currentWidget() is w.metric_charts:
            w.metric_charts.refresh(w.metric_history)
            if w.kv_stack.currentWidget() is w.kv_aggregate:
                w.kv_aggregate.redraw(force=True)
            else:
                w.prefix_tree.redraw(force=True)
            return
        w.charts.refresh(w.history)
        w.block_map.redraw(force=True)
