"""The main window as its parts see it (ui/window/engine.py, options.py, remote.py, disagg.py,
api.py, feed.py): the panels, the shared state and the few actions they call. `MainWindow`
provides it; the parts are handed the window typed as `WindowHost`, so none of them imports
ui/window/main_window.py back (the import graph stays a tree).

The parts reach one another through the window only by the small protocols below, which name
exactly what one part asks of another."""

from __future__ import annotations

import collections
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from PySide6.QtCore import QSettings, QTimer
from PySide6.QtGui import QAction
from PySide6.QtWidgets import (
    QMessageBox,
    QSplitter,
    QStackedWidget,
    QStatusBar,
    QTabWidget,
)

from app.remote.probe import ServerInfo
from app.supervisor import EngineSupervisor
from ui.charts.engine import ChartsWidget
from ui.charts.experts import ExpertRoutingView
from ui.chat.panel import ChatPanel
from ui.chat.token_counter import TokenCounter
from ui.engine.link import EngineLink
from ui.kv.block_map import BlockMapWidget
from ui.kv.prefix_tree import PrefixTreePanel
from ui.remote.charts import MetricsChartsWidget
from ui.remote.kv_aggregate import KvAggregateWidget
from ui.remote.link import RemoteLink
from ui.remote.metrics_history import MetricsHistory
from ui.telemetry import Frame, History
from ui.window.api_server import ApiServer, ApiServerDialog
from ui.window.banner import EngineBanner
from ui.window.connect_dialog import ConnectDialog
from ui.window.controls import ControlsPanel, LoadPanel
from ui.window.source import EngineSource
from ui.window.status_bar import StatusBarView


class LifecyclePart(Protocol):
    """ui/window/engine.py's EngineLifecycle, as the other parts call it."""

    def fail(self, why: str) -> None: ...
    def restart(self) -> None: ...
    def on_frames(self, frames: list) -> None: ...
    def on_stalled(self, why: str) -> None: ...
    def on_recovered(self) -> None: ...


class RemotePart(Protocol):
    """ui/window/remote.py's RemoteWatch, as the other parts call it."""

    aliases: dict[str, str]

    def reset(self) -> None: ...
    def open_link(self, url: str) -> None: ...
    def set_controls_remote(self, url: str | None) -> None: ...
    def engine_rid(self, rid: str, histories: Iterable[History] | None = None) -> str | None: ...


class FeedPart(Protocol):
    """ui/window/feed.py's TelemetryFeed, as the other parts call it."""

    timer: QTimer

    def on_replies(self, msgs: list) -> None: ...
    def on_frames(self, frames: list[Frame]) -> None: ...
    def on_prefix_tree(self, layout: object, in_sync: bool) -> None: ...


class KvEventsPart(Protocol):
    """ui/window/kv_events.py's KvEventsWatch, as the other parts call it."""

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def on_connected(self, info: ServerInfo) -> None: ...


class ApiPart(Protocol):
    """ui/window/api.py's ApiToggle, as the other parts call it."""

    def on_frame(self) -> None: ...


class WindowHost(Protocol):
    # what it is attached to, and how that goes
    settings: QSettings
    source: EngineSource
    data_dir: Path | None
    state: str
    closing: bool
    link: EngineLink | RemoteLink | None
    supervisor: EngineSupervisor | None
    engine_endpoint: str | None
    welcome: Any
    last_error: str
    remote_info: ServerInfo | None
    want_highlight: str | None
    history: History
    metric_history: MetricsHistory
    perf: dict[str, collections.deque[float]]
    # panels
    chat: ChatPanel
    token_counter: TokenCounter
    block_map: BlockMapWidget
    prefix_tree: PrefixTreePanel
    expert_view: ExpertRoutingView
    charts: ChartsWidget
    kv_aggregate: KvAggregateWidget
    metric_charts: MetricsChartsWidget
    controls: ControlsPanel
    load_panel: LoadPanel
    kv_tabs: QTabWidget
    kv_stack: QStackedWidget
    chart_stack: QStackedWidget
    main_split: QSplitter  # chat | the engine's views
    right_split: QSplitter  # KV views / charts / controls
    status: StatusBarView
    banner: EngineBanner
    connect_dialog: ConnectDialog | None
    # the OpenAI API server and its menu item
    api: ApiServer
    api_action: QAction
    api_dialog: ApiServerDialog | None
    api_error_box: QMessageBox | None
    decode_weight_actions: dict[str, QAction]
    # the other parts
    lifecycle: LifecyclePart
    remote: RemotePart
    feed: FeedPart
    api_toggle: ApiPart
    kv_events: KvEventsPart

    def statusBar(self) -> QStatusBar: ...  # noqa: N802 - Qt's name
    def saveGeometry(self) -> Any: ...  # noqa: N802 - Qt's name
    def restoreGeometry(self, geometry: Any) -> bool: ...  # noqa: N802 - Qt's name
    def resize(self, width: int, height: int) -> None: ...
    def set_state(self, state: str, detail: str = "") -> None: ...
    def update_menu(self) -> None: ...
    def restart_engine(self) -> None: ...
    def sync_tree_wanted(self) -> None: ...
    def on_control_reply(self, msg: Any) -> None: ...
    def on_block_request_selected(self, rid: str) -> None: ...
    def confirm_restart(self, in_flight: int, what: str = "the decode weights") -> bool: ...
    def set_decode_weights(self, value: str) -> None: ...
    def set_kv_cache_dtype(self, value: str) -> None: ...
    def set_kv_host_memory(self, nbytes: int) -> None: ...
    def set_kv_disk_bytes(self, nbytes: int) -> None: ...
    def set_speculative_tokens(self, k: int) -> None: ...
