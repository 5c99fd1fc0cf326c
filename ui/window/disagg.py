"""The main window attached over HTTP to a disaggregated KVScope deployment (`kvscope serve
--disaggregated`): the link's two telemetry streams (ui/remote/disagg.py) into a History per
engine and the transfer history, drawn by the two-pool KV panel (ui/disagg/panel.py) and the
per-engine charts (ui/disagg/charts.py), which take the block map's and the charts' places in
the window's stacks while such a deployment is watched. Chats go through the HTTP API as with
any server (ui/window/remote.py).

Its panels redraw on the window's refresh timer, one part per tick (the prefill map, the decode
map, then each chart column with the strip), only while they are shown.
"""

from __future__ import annotations

import time

from PySide6.QtCore import QObject

from app.remote.kvscope_http import ROLES
from app.remote.probe import ServerInfo
from ui.disagg.charts import DisaggChartsWidget
from ui.disagg.panel import DisaggKvPanel
from ui.disagg.telemetry import TransferHistory
from ui.telemetry import Frame, History
from ui.units import human_bytes
from ui.window.host import WindowHost
from ui.window.status_bar import kv_formula

PHASES: tuple[str | int, ...] = (*ROLES, 0, 1, 2)  # the two maps, then the chart columns


class DisaggView(QObject):
    def __init__(self, window: WindowHost) -> None:
        super().__init__(window)
        self.w = window
        self.panel: DisaggKvPanel | None = None
        self.charts: DisaggChartsWidget | None = None
        self.histories = {role: History() for role in ROLES}
        self.transfer = TransferHistory()
        self.welcomes: dict[str, object] = {}
        self.down: dict[str, str] = dict.fromkeys(ROLES, "")
        self.active = False
        self._tick = 0

    @property
    def shown(self) -> bool:
        return self.active and self.panel is not None and \
            self.w.kv_stack.currentWidget() is self.panel

    def _build(self) -> None:
        """The panels, made when a disaggregated deployment is first watched."""
        w = self.w
        self.panel, self.charts = DisaggKvPanel(), DisaggChartsWidget()
        w.kv_stack.addWidget(self.panel)
        w.chart_stack.addWidget(self.charts)
        w.feed.timer.timeout.connect(self._refresh)
        for block_map in self.panel.maps.values():
            block_map.request_selected.connect(self._on_map_selected)
        w.chat.conversation_selected.connect(self._on_conversation_selected)

    # --- what the link says ----------------------------------------------------------------
    def show(self, info: ServerInfo) -> None:
        """A disaggregated deployment (again: an engine may have restarted)."""
        if self.panel is None:
            self._build()
        assert self.panel is not None and self.charts is not None and info.deployment
        dep = info.deployment
        for role in ROLES:
            new, old = dep.welcomes.get(role), self.welcomes.get(role)
            if old is not None and new is not None and new != old:
                self.clear(role)  # another engine process: its counters start over
            state = dep.engines.get(role, "gone")
            if role not in self.welcomes and state != "ready":  # from discovery
                self.down[role] = f"{state}: {dep.detail.get(role, '')}".rstrip(": ")
                self.panel.pools[role].set_down(self.down[role])
        self.welcomes = dict(dep.welcomes)
        self.active = True
        self.w.kv_stack.setCurrentWidget(self.panel)
        self.w.chart_stack.setCurrentWidget(self.charts)
        self._show_status(info)

    def _show_status(self, info: ServerInfo) -> None:
        w = self.w
        models = {role: wel.model for role, wel in self.welcomes.items() if wel is not None}
        model = models.get("decode") or models.get("prefill") or info.welcome.model
        w.status.show_engine(model)
        label = w.status.model_label
        label.setText(f"{label.text()} · KVScope prefill/decode pair at {info.url}")
        pools = " + ".join(
            f"{role} {m.num_blocks:,}" for role, m in models.items()) or f"{model.num_blocks:,}"
        total = sum(m.num_blocks * m.block_size * m.kv_bytes_per_token for m in models.values())
        w.status.kv_label.setText(
            f"{pools} blocks × {model.block_size} tokens · {kv_formula(model)} · KV pools "
            f"{human_bytes(total)} · max len {model.max_model_len:,}")

    def leave(self) -> None:
        """Another kind of server, or another start: the stacks go back to the window."""
        self.active = False
        self.welcomes = {}
        self.down = dict.fromkeys(ROLES, "")
        self.clear()

    def clear(self, role: str | None = None) -> None:
        for r in (role,) if role else ROLES:
            self.histories[r].clear()
            if r == "decode":
                self.transfer.clear_decode()
            else:
                self.transfer.clear_prefill()
            if self.panel is not None and self.charts is not None:
                self.panel.clear(r)
                self.charts.clear(r)
                if r == "decode":
                    self.charts.clear("transfer")
        if role is None and self.panel is not None:
            self.panel.strip.show_rates(self.transfer.rates)

    def on_frames(self, by_role: dict[str, list[Frame]]) -> None:
        w = self.w
        if self.sender() is not w.link or self.panel is None:
            return
        t0 = time.perf_counter()
        for role, frames in by_role.items():
            history = self.histories[role]
            add = self.transfer.add_decode if role == "decode" else self.transfer.add_prefill
            for f in frames:
                history.add(f)
                add(f)
            self.panel.pools[role].set_frame(frames[-1], history.last_tables)
        self._resolve_highlight()
        self._show_state()
        w.perf["frames"].append(time.perf_counter() - t0)

    def on_engine_status(self, role: str, why: str) -> None:
        if self.sender() is not self.w.link or self.panel is None:
            return
        self.down[role] = why
        self.panel.pools[role].set_down(why)

    def _show_state(self) -> None:
        w = self.w
        if w.state not in ("ready", "busy"):
            return
        parts, busy = [], False
        for role in ROLES:
            latest = self.histories[role].latest
            if latest is None:
                continue
            running = latest.counters.get("num_requests_running", 0)
            waiting = latest.counters.get("num_requests_waiting", 0)
            busy = busy or bool(running or waiting)
            parts.append(f"{role} {running:.0f} running, {waiting:.0f} waiting")
        w.set_state("busy" if busy else "ready", " · ".join(parts) if busy else "")

    # --- drawing -------------------------------------------------------------------------------
    def _refresh(self) -> None:
        if not self.shown:
            return
        assert self.panel is not None and self.charts is not None
        t0 = time.perf_counter()
        phase = PHASES[self._tick % len(PHASES)]
        self._tick += 1
        if isinstance(phase, str):
            self.panel.pools[phase].redraw()
        else:
            self.charts.refresh(self.histories, self.transfer, part=phase)
            if phase == 2:
                self.panel.strip.show_rates(self.transfer.rates)
        self.w.perf["refresh"].append(time.perf_counter() - t0)

    def redraw_now(self) -> None:
        """Every panel at once, titles included (screenshots, tests)."""
        if self.panel is None or self.charts is None:
            return
        for pool in self.panel.pools.values():
            pool.redraw(force=True)
        self.charts.refresh(self.histories, self.transfer, force_titles=True)
        self.panel.strip.show_rates(self.transfer.rates)

    # --- a request in both pools ------------------------------------------------------------
    def highlight(self, rid: str | None) -> None:
        """The same request in both pools (the router gives it one id on both engines)."""
        if self.panel is not None:
            for block_map in self.panel.maps.values():
                if block_map.highlight_rid != rid:
                    block_map.highlight_request(rid)

    def _on_map_selected(self, rid: str) -> None:
        self.highlight(rid or None)
        self.w.on_block_request_selected(rid)  # its conversation, when it is one of ours

    def _on_conversation_selected(self, conv_id: str, rid: str) -> None:
        if self.active and self.w.source.is_remote:
            self.highlight(self.w.remote.engine_rid(rid, self.histories.values()) if rid
                           else None)

    def _resolve_highlight(self) -> None:
        """A chat selected before its request reached the engines: found by now?"""
        want = self.w.want_highlight
        if want is None or self.panel is None:
            return
        erid = self.w.remote.engine_rid(want, self.histories.values())
        if erid is not None and erid != self.panel.maps["decode"].highlight_rid:
            self.highlight(erid)
