"""The main window watching a server over HTTP (`--connect http://HOST:PORT`, *Engine → Connect
to server…*): the connect dialog and the way back to the local engine, the `RemoteLink`'s
signals, the swap of the block map and charts for the aggregate KV panel and the /metrics charts
when the server has no per-block telemetry (or for the two pools and per-engine charts of a
disaggregated KVScope deployment: ui/window/disagg.py), greyed-out engine controls, and the ids
a KVScope front-end gives the window's chats in its engine."""

from __future__ import annotations

import time
from collections.abc import Iterable

from PySide6.QtCore import QObject

from app.remote.kv_events_source import KvEventsSource
from app.remote.probe import ServerInfo
from app.remote.samples import MetricSample
from ui.remote.link import RemoteLink
from ui.telemetry import History
from ui.window.api_server import OFF
from ui.window.connect_dialog import ConnectDialog, recent_urls, remember_url
from ui.window.controls import config_dict
from ui.window.disagg import DisaggView
from ui.window.host import WindowHost

NEEDS_ZMQ = ("needs the engine protocol: this window watches {url} over HTTP (attach to a KVScope "
             "engine with --connect tcp://HOST:PORT to change its limits)")


class RemoteWatch(QObject):
    """Slots for the connect dialog and a `RemoteLink` (a QObject, so that `sender()` tells the
    current link or dialog from a replaced one)."""

    def __init__(self, window: WindowHost) -> None:
        super().__init__(window)
        self.w = window
        # where "back to the local engine" goes: what we were started with, unless it is HTTP
        self.local_connect = None if window.source.is_remote else window.source.connect
        self.metrics_problem = ""
        self.aliases: dict[str, str] = {}  # chat request id -> its HTTP response id
        self.disagg = DisaggView(window)  # a prefill/decode deployment's panels

    # --- choosing a server -------------------------------------------------------------------
    def open_connect_dialog(self) -> None:
        dialog = ConnectDialog(recent_urls(self.w.settings), self.w)
        dialog.accepted.connect(self._on_connect_dialog_accepted)
        dialog.finished.connect(dialog.deleteLater)
        self.w.connect_dialog = dialog
        dialog.open()  # window-modal, returns at once

    def _on_connect_dialog_accepted(self) -> None:
        dialog = self.sender()
        if dialog is not self.w.connect_dialog:
            return
        self.w.connect_dialog = None
        url, key = dialog.values()
        self.connect_to(url, key, dialog.kv_events_source())

    def connect_to(self, url: str, api_key: str | None = None,
                   kv_events: KvEventsSource | None = None) -> None:  # fmt: skip
        """Watch the server at `url` (remembered in the recent list; the key is not), and its
        KV event publisher when `kv_events` names one."""
        w = self.w
        remember_url(w.settings, url)
        if w.api.state != OFF:
            w.api.stop()  # it fronted our own engine, which we are leaving
        w.source.connect, w.source.api_key = url, api_key
        w.source.kv_events = kv_events
        w.update_menu()
        w.restart_engine()

    def use_local_engine(self) -> None:
        w = self.w
        w.source.connect, w.source.api_key = self.local_connect, None
        w.source.kv_events = None
        w.update_menu()
        w.restart_engine()

    # --- the link ------------------------------------------------------------------------------
    def reset(self) -> None:
        """An engine or server is about to be (re)started: the per-block views until a server
        over HTTP turns out to have none."""
        w = self.w
        w.remote_info = None
        self.metrics_problem = ""
        w.kv_events.stop()
        self.disagg.leave()
        self.show_notes()
        w.kv_stack.setCurrentWidget(w.kv_tabs)
        w.chart_stack.setCurrentWidget(w.charts)
        self.set_controls_remote(w.source.connect if w.source.is_remote else None)

    def open_link(self, url: str) -> None:
        w = self.w
        try:
            options = {"stall_timeout": min(w.source.stall_timeout, 10.0),
                       **w.source.link_options}
            link = RemoteLink(url, api_key=w.source.api_key, **options)
        except ValueError as exc:
            w.lifecycle.fail(str(exc))
            return
        link.connected.connect(self._on_connected)
        link.connect_failed.connect(self._on_connect_failed)
        link.replies.connect(w.feed.on_replies)
        link.frames.connect(w.feed.on_frames)
        link.frames.connect(w.lifecycle.on_frames)  # the lower KV tiers line
        link.role_frames.connect(self.disagg.on_frames)
        link.engine_status.connect(self.disagg.on_engine_status)
        link.metrics.connect(self._on_metrics)
        link.metrics_problem.connect(self._on_metrics_problem)
        link.alias.connect(self._on_alias)
        link.control_reply.connect(w.on_control_reply)
        link.load_stats.connect(w.load_panel.show_stats)
        link.stalled.connect(w.lifecycle.on_stalled)
        link.recovered.connect(w.lifecycle.on_recovered)
        w.link = link
        link.start()
        w.kv_events.start()

    def _on_connected(self, info: ServerInfo) -> None:
        w = self.w
        if self.sender() is not w.link:
            return
        previous = w.remote_info
        if previous is not None and info.per_block and info.welcome is not previous.welcome:
            # the server came back with another engine: its counters and blocks start over
            w.history.clear()
            w.charts.clear()
            w.block_map.clear()
        w.remote_info = info
        w.status.hide_progress()
        per_block = info.per_block
        if self.disagg.active and not info.disaggregated:
            self.disagg.leave()  # the server came back as something else
        w.kv_stack.setCurrentWidget(w.kv_tabs if per_block else w.kv_aggregate)
        w.chart_stack.setCurrentWidget(w.charts if per_block else w.metric_charts)
        if info.disaggregated:
            w.welcome = info.welcome
            self.disagg.show(info)
            w.controls.show_config(config_dict(info.welcome.config))
        elif per_block:
            w.welcome = info.welcome
            w.status.show_engine(info.welcome.model)
            w.block_map.vocab_size = info.welcome.model.vocab_size
            label = w.status.model_label
            label.setText(f"{label.text()} · KVScope at {info.url}")
            w.controls.show_config(config_dict(info.welcome.config))
        else:
            w.welcome = None
            w.kv_aggregate.set_server(info.kind)
            self.show_server(info)
        w.kv_events.on_connected(info)
        self.show_notes()
        self.set_controls_remote(info.url)
        w.load_panel.setEnabled(True)
        w.chat.set_engine_ready(True)
        if w.state not in ("ready", "busy"):
            w.banner.setVisible(False)
            w.set_state("ready")

    def _on_connect_failed(self, why: str) -> None:
        if self.sender() is self.w.link:  # not a late word from a link we have replaced
            self.w.lifecycle.fail(f"could not connect: {why}")

    def _on_metrics(self, sample: MetricSample) -> None:
        w = self.w
        if self.sender() is not w.link:
            return
        t0 = time.perf_counter()
        first = w.metric_history.latest is None
        w.metric_history.add(sample)
        w.kv_aggregate.set_sample(sample)
        if first and w.remote_info is not None and not w.remote_info.per_block:
            self.show_server(w.remote_info)  # ranks and pool size come with the first one
        if w.state in ("ready", "busy"):
            running, waiting = sample.running or 0, sample.waiting or 0
            w.set_state("busy" if running or waiting else "ready",
                        f"{running:.0f} running, {waiting:.0f} waiting" if running or waiting
                        else "")
        w.perf["frames"].append(time.perf_counter() - t0)

    def _on_metrics_problem(self, why: str) -> None:
        if self.sender() is not self.w.link:
            return
        self.metrics_problem = why
        self.show_notes()

    # --- what the window shows ---------------------------------------------------------------
    def show_server(self, info: ServerInfo) -> None:
        self.w.status.show_server(info, self.w.metric_history.latest)

    def show_notes(self) -> None:
        self.w.status.show_server_notes(self.w.remote_info, self.metrics_problem)

    def set_controls_remote(self, url: str | None) -> None:
        """Engine controls need the ZeroMQ protocol: greyed out, with the reason, over HTTP
        (`url`); None puts the engine's own tooltips back (enabled once an engine connects)."""
        controls = self.w.controls
        tip = NEEDS_ZMQ.format(url=url) if url else ""
        if url:
            controls.setEnabled(False)
        controls.setToolTip(tip)
        for widget in (*controls.sliders.values(), controls.auto_chunk, controls.prefix,
                       controls.flush):
            widget.setProperty("engine_tip", widget.property("engine_tip") or widget.toolTip())
            widget.setToolTip(tip or widget.property("engine_tip"))
        controls.show_result(
            "engine controls: only over the engine protocol (ZeroMQ)" if url else "")

    # --- the window's chats in the server's engine ---------------------------------------------
    def _on_alias(self, rid: str, response_id: str) -> None:
        if self.sender() is self.w.link:
            self.aliases[rid] = response_id

    def engine_rid(self, rid: str, histories: Iterable[History] | None = None) -> str | None:
        """The engine's id of a chat sent over HTTP (a KVScope front-end names its engine
        request after the response id: "<chatcmpl-...>-<suffix>"), looked up in the window's
        history or in `histories` (a disaggregated deployment's engines); None while unknown."""
        alias = self.aliases.get(rid)
        if alias is None:
            return None
        for history in (self.w.history,) if histories is None else histories:
            latest = history.latest
            live = [r.request_id for r in latest.requests] if latest is not None else []
            for erid in (*live, *history.last_tables):
                if erid == alias or erid.startswith(alias + "-"):
                    return erid
        return None

    def chat_rid_of(self, engine_rid: str) -> str:
        for rid, alias in self.aliases.items():
            if engine_rid == alias or engine_rid.startswith(alias + "-"):
                return rid
        return engine_rid
