"""The main window: chat on the left; block map, charts and controls on the right; engine state in
the status bar; an error banner with the engine's last log lines and Restart when it fails.

This module builds the panels, the layout and the Engine menu, wires the signals, holds what the
parts share (the link, the supervisor, the state, the histories) and links the chat with the block
map. Each other concept has its own module, a collaborator holding a reference to the window:

- ui/window/engine.py (`window.lifecycle`): `EngineSource`, spawning or attaching to the engine
  (one `EngineLink` worker thread carries all ZeroMQ traffic), restart, the error banner when the
  engine fails or stops answering.
- ui/window/engine_menu.py: the *Engine* menu, and what it offers by what the window is
  attached to.
- ui/window/options.py (`window.option_menus`): *Decode weights* and *KV cache*, the options the
  engine starts with.
- ui/window/models_menu.py (`window.model_menu`): *File → Open model…* and *File → Models…*
  (ui/models/dialog.py), which restart the engine on the chosen model.
- ui/window/remote.py (`window.remote`): `--connect http://HOST:PORT` or *Engine → Connect to
  server…*: vLLM, SGLang, llama.cpp's server or a KVScope front-end, through one `RemoteLink`
  worker thread (ui/remote/link.py). A KVScope server feeds the same block map and charts from its
  telemetry stream; the others feed the /metrics charts (ui/remote/charts.py) and an aggregate KV
  panel (ui/remote/kv_aggregate.py), which take the block map's and the charts' places.
- ui/window/api.py (`window.api_toggle`): *Engine → Serve OpenAI API…*, an HTTP front-end for the
  same engine (ui/window/api_server.py).
- ui/window/feed.py (`window.feed`): replies and telemetry frames into the panels, redraws.
- ui/window/status_bar.py (`window.status`): what the status bar says.
- ui/kv/tier_panel.py (`window.tier_panel`): the KV tiers strip under the block map.
"""

from __future__ import annotations

import collections
import logging
import time

from PySide6.QtCore import Qt
from PySide6.QtGui import QCloseEvent
from PySide6.QtWidgets import (
    QHBoxLayout,
    QMainWindow,
    QMessageBox,
    QSplitter,
    QStackedWidget,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from app.conversations import ConversationStore
from app.load_generator import LoadConfig
from app.remote.probe import ServerInfo
from app.settings import load_sampling
from app.supervisor import EngineSupervisor
from ui.charts.engine import ChartsWidget
from ui.charts.experts import ExpertRoutingView
from ui.chat.chat_menu import ChatMenu
from ui.chat.panel import ChatPanel
from ui.chat.token_counter import TokenCounter
from ui.engine.link import EngineLink
from ui.fleet.opener import FleetOpener
from ui.kv.block_map import BlockMapWidget
from ui.kv.prefix_tree import PrefixTreePanel
from ui.kv.tier_panel import TierPanel
from ui.remote.charts import MetricsChartsWidget
from ui.remote.kv_aggregate import KvAggregateWidget
from ui.remote.link import RemoteLink
from ui.remote.metrics_history import MetricsHistory
from ui.telemetry import History
from ui.window.api import ApiToggle
from ui.window.api_server import ApiServer, ApiServerDialog
from ui.window.banner import EngineBanner
from ui.window.connect_dialog import ConnectDialog
from ui.window.controls import ControlsPanel, LoadPanel, config_dict
from ui.window.engine import EngineLifecycle
from ui.window.engine_menu import build_engine_menu, update_engine_menu
from ui.window.feed import TelemetryFeed
from ui.window.kv_events import KvEventsWatch
from ui.window.models_menu import ModelMenu
from ui.window.options import EngineOptionMenus
from ui.window.persist import restore_window_state, save_window_state
from ui.window.remote import RemoteWatch
from ui.window.source import EngineSource
from ui.window.status_bar import StatusBarView

__all__ = ["EngineSource", "MainWindow", "wait_until"]

log = logging.getLogger(__name__)


class MainWindow(QMainWindow):
    """The panels and what they share; the collaborators (module docstring) act on them."""

    def __init__(self, settings, store: ConversationStore, source: EngineSource, *,
                 refresh_hz: float = 10.0, data_dir=None) -> None:
        super().__init__()
        self.settings = settings
        self.source = source
        self.data_dir = data_dir
        self.history = History()
        self.state = "starting"
        self.link: EngineLink | RemoteLink | None = None
        self.remote_info: ServerInfo | None = None  # the server watched over HTTP, when one is
        self.metric_history = MetricsHistory()
        self.connect_dialog: ConnectDialog | None = None
        self.want_highlight: str | None = None  # a chat not yet resolved to an engine request
        self.supervisor: EngineSupervisor | None = None
        self.welcome = None
        self.last_error = ""
        self.closing = False
        self.engine_endpoint: str | None = None  # where the link connects (what the API fronts)
        self.api = ApiServer(token=source.token,
                             log_file=(data_dir / "api.log") if data_dir else None, parent=self)
        self.api_dialog: ApiServerDialog | None = None
        self.api_error_box: QMessageBox | None = None
        # seconds spent in the GUI thread's own handlers (the latency benchmark reports them)
        self.perf: dict[str, collections.deque[float]] = {
            k: collections.deque(maxlen=10_000) for k in ("refresh", "frames", "replies")}
        self.lifecycle = EngineLifecycle(self)
        self.option_menus = EngineOptionMenus(self)
        self.model_menu = ModelMenu(self)
        self.remote = RemoteWatch(self)
        self.kv_events = KvEventsWatch(self)  # a server's KV events (vLLM's format), when named
        self.fleet = FleetOpener(self)  # fleet panels (ui/fleet/), windows of their own
        self._chat_aliases = self.remote.aliases  # chat request id -> its HTTP response id
        self.api_toggle = ApiToggle(self)
        self.feed = TelemetryFeed(self, refresh_hz)
        self.setWindowTitle("KVScope")

        self.chat = ChatPanel(store, load_sampling(settings))
        # token counts of attachments (ui/chat/attachment_bar.py); its replies come in feed.py
        self.token_counter = TokenCounter(self._tokenize, parent=self)
        self.chat.attach_bar.set_counter(self.token_counter)
        self.block_map = BlockMapWidget()
        self.prefix_tree = PrefixTreePanel()
        self.expert_view = ExpertRoutingView()  # its tab is shown for routed-experts models
        self.charts = ChartsWidget()
        self.kv_aggregate = KvAggregateWidget()
        self.tier_panel = TierPanel()  # pool, host, disk: hidden without lower tiers
        self.metric_charts = MetricsChartsWidget()
        self.controls = ControlsPanel()
        self.load_panel = LoadPanel()
        self._build_layout()
        self.status = StatusBarView(self.statusBar())
        # the labels tests and tools read, by their old names
        self.model_label, self.kv_label = self.status.model_label, self.status.kv_label
        self.api_label, self.remote_label = self.status.api_label, self.status.remote_label
        self.set_state("starting")
        self._build_menu()

        self.chat.submit.connect(self._on_submit)
        self.chat.abort.connect(self._on_abort)
        self.chat.conversation_selected.connect(self._on_conversation_selected)
        self.chat.branch_sent.connect(self._on_branch_sent)
        self.block_map.request_selected.connect(self.on_block_request_selected)
        self.controls.control.connect(self._on_control)
        self.load_panel.start.connect(self.start_load)
        self.load_panel.stop.connect(lambda: self.link and self.link.stop_load())
        self.api.state_changed.connect(self.api_toggle.on_state)
        self.api.failed.connect(self.api_toggle.on_failed)
        self.api.restarted.connect(lambda ep: log.info("API server restarted against %s", ep))
        self.feed.timer.timeout.connect(lambda: self.tier_panel.show_frame(self.history.latest))
        self.feed.timer.start()
        restore_window_state(self)

    @property
    def _frames_seen(self) -> int:  # `python -m app --measure-latency` reads it
        return self.feed.frames_seen

    # --- layout ----------------------------------------------------------------------------
    def _build_layout(self) -> None:
        self.banner = EngineBanner(self.restart_engine)

        bottom = QWidget()
        bot = QHBoxLayout(bottom)
        bot.setContentsMargins(0, 0, 0, 0)
        bot.addWidget(self.controls, 3)
        bot.addWidget(self.load_panel, 2)

        # per-block views, or (servers without per-block telemetry) the aggregate ones
        self.kv_tabs = QTabWidget()
        self.kv_tabs.setDocumentMode(True)
        self.kv_tabs.addTab(self.block_map, "Blocks")
        self.kv_tabs.addTab(self.prefix_tree, "Prefix tree")
        self.kv_tabs.addTab(self.expert_view, "Experts")
        self.kv_tabs.setTabVisible(self.kv_tabs.indexOf(self.expert_view), False)
        self.kv_tabs.currentChanged.connect(lambda _: self.sync_tree_wanted())
        self.kv_stack = QStackedWidget()
        self.kv_stack.addWidget(self.kv_tabs)
        self.kv_stack.addWidget(self.kv_aggregate)
        kv_area = QWidget()  # the KV views, and under them the tiers strip
        kl = QVBoxLayout(kv_area)
        kl.setContentsMargins(0, 0, 0, 0)
        kl.setSpacing(2)
        kl.addWidget(self.kv_stack, 1)
        kl.addWidget(self.tier_panel)
        self.chart_stack = QStackedWidget()
        self.chart_stack.addWidget(self.charts)
        self.chart_stack.addWidget(self.metric_charts)
        right = QSplitter(Qt.Orientation.Vertical)
        right.addWidget(kv_area)
        right.addWidget(self.chart_stack)
        right.addWidget(bottom)
        right.setStretchFactor(0, 3)
        right.setStretchFactor(1, 4)
        right.setStretchFactor(2, 0)
        right.setSizes([330, 430, 150])
        self.right_split = right

        main = QSplitter(Qt.Orientation.Horizontal)
        main.addWidget(self.chat)
        main.addWidget(right)
        main.setStretchFactor(0, 2)
        main.setStretchFactor(1, 3)
        main.setSizes([640, 960])
        self.main_split = main

        central = QWidget()
        cl = QVBoxLayout(central)
        cl.setContentsMargins(4, 4, 4, 0)
        cl.addWidget(self.banner)
        cl.addWidget(main, 1)
        self.setCentralWidget(central)

    def _build_menu(self) -> None:
        self.model_menu.add_file_menu(self.menuBar())
        build_engine_menu(self)
        self.chat_menu = ChatMenu(self.chat, self)
        self.chat_menu.add_to(self.menuBar())
        self.update_menu()

    def update_menu(self) -> None:
        update_engine_menu(self)

    def set_state(self, state: str, detail: str = "") -> None:
        self.state = state
        self.status.show_state(state, detail)

    # --- the engine, a server over HTTP (ui/window/engine.py, ui/window/remote.py) --------------
    def start_engine(self) -> None:
        self.lifecycle.start()

    def restart_engine(self) -> None:
        self.lifecycle.restart()

    def set_decode_weights(self, value: str) -> None:
        """Remember the choice and restart a spawned engine with it (an attached engine keeps
        whatever it was started with)."""
        self.option_menus.set_decode_weights(value)

    def set_kv_cache_dtype(self, value: str) -> None:
        """*Engine → KV cache → Element type*: "auto", a float type ("fp32", "fp16") or a
        quantised one ("int8", "fp8")."""
        self.option_menus.set_kv_cache_dtype(value)

    def set_kv_host_memory(self, nbytes: int) -> None:
        """*Engine → KV cache → Host memory tier*: bytes, 0 = off."""
        self.option_menus.set_kv_host_memory(nbytes)

    def set_kv_disk_bytes(self, nbytes: int) -> None:
        """*Engine → KV cache → Disk tier*: bytes in <data dir>/kv-cache, 0 = off."""
        self.option_menus.set_kv_disk_bytes(nbytes)

    def set_speculative_tokens(self, k: int) -> None:
        """*Engine → Speculative decoding*: n-gram draft tokens per step, 0 = off."""
        self.option_menus.set_speculative_tokens(k)

    def confirm_restart(self, in_flight: int, what: str = "the decode weights") -> bool:
        answer = QMessageBox.question(
            self, "Restart the engine",
            f"Changing {what} restarts the engine: {in_flight} reply(s) in progress "
            "will stop (the text so far is kept). Restart now?")
        return answer == QMessageBox.StandardButton.Yes

    def open_connect_dialog(self) -> None:
        self.remote.open_connect_dialog()

    def connect_to(self, url: str, api_key: str | None = None, kv_events=None) -> None:
        """Watch the server at `url` (remembered in the recent list; the key is not), and its
        KV event publisher when `kv_events` (an app.remote.kv_events_source.KvEventsSource)
        names one."""
        self.remote.connect_to(url, api_key, kv_events)

    def use_local_engine(self) -> None:
        self.remote.use_local_engine()

    def redraw_now(self) -> None:
        """Both panels at once (screenshots)."""
        self.feed.redraw_now()
        self.remote.disagg.redraw_now()  # a disaggregated deployment's panels, when shown

    # --- requests and controls --------------------------------------------------------------
    def _on_submit(self, rid: str, messages: list, sampling: dict) -> None:
        if self.link is None:
            self.chat.interrupt_all("no engine")
            return
        self.link.generate(rid, messages, sampling)

    def _tokenize(self, rid: str, text: str) -> bool:
        """TokenCounter's `send`: False (estimate) when the link has no tokenizer to ask (a
        remote HTTP server, the demo, no link)."""
        tokenize = getattr(self.link, "tokenize", None)
        return bool(tokenize is not None and tokenize(rid, text))

    def _on_abort(self, rid: str) -> None:
        if self.link is not None:
            self.link.abort(rid)

    def _on_conversation_selected(self, conv_id: str, rid: str) -> None:
        if self.source.is_remote and rid:
            # a chat over HTTP has another id in the engine: found once the server names it
            self.want_highlight = rid
            self.block_map.highlight_request(self.remote.engine_rid(rid))
            self.prefix_tree.highlight_request(self.remote.engine_rid(rid))
            return
        self.want_highlight = None
        self.block_map.highlight_request(rid or None)
        self.prefix_tree.highlight_request(rid or None)

    def _on_branch_sent(self, rid: str, source_rid: str) -> None:
        """An edited or regenerated chat branch: the block map marks what it shares."""
        if not self.source.is_remote:
            self.block_map.show_fork(rid, source_rid)

    def sync_tree_wanted(self) -> None:
        """The link's worker lays the prefix tree out only while its tab is shown."""
        tracker = getattr(self.link, "tree", None)
        if tracker is not None:
            tracker.wanted = self.kv_tabs.currentWidget() is self.prefix_tree
        self.kv_events.sync_wanted()

    def on_block_request_selected(self, rid: str) -> None:
        """A request picked in the block map: show its conversation when it is one of ours."""
        self.want_highlight = None
        if self.source.is_remote:
            rid = self.remote.chat_rid_of(rid)
        for conv_id, last in self.chat.last_request.items():
            if last == rid and (self.chat.current is None or self.chat.current.id != conv_id):
                self.chat.conversation_selected.disconnect(self._on_conversation_selected)
                try:
                    self.chat.select_conversation(conv_id)
                finally:
                    self.chat.conversation_selected.connect(self._on_conversation_selected)
                break

    def _on_control(self, op: str, fields: dict) -> None:
        if self.link is not None:
            self.link.control(op, **fields)

    def on_control_reply(self, msg) -> None:
        if type(msg).__name__ == "ControlAck":
            self.controls.show_config(config_dict(msg.config))
            extra = ""
            if msg.op == "reset_prefix_cache":
                extra = ": flushed" if msg.result else ": nothing to flush (blocks in use)"
            self.controls.show_result(f"{msg.op} ok{extra}")
        else:
            self.controls.show_result(f"{msg.code}: {msg.message}", error=True)

    def start_load(self, config: LoadConfig) -> None:
        if self.link is not None:
            self.load_panel.set_running(True)
            self.link.start_load(config)

    # --- shutdown --------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Save everything, close the link, stop a spawned engine. Idempotent."""
        if self.closing:
            return
        self.closing = True
        self.feed.timer.stop()
        self.chat.shutdown()
        save_window_state(self)
        if self.link is not None:
            self.link.stop(timeout=2.0)
            self.link = None
        self.kv_events.stop()
        self.fleet.shutdown()
        self.api.shutdown()
        if self.supervisor is not None:
            self.supervisor.stop(timeout=5.0)
        self.set_state("stopped")

    def closeEvent(self, ev: QCloseEvent) -> None:  # noqa: N802 - Qt name
        self.shutdown()
        super().closeEvent(ev)


def wait_until(pred, timeout: float, app) -> bool:
    """Spin the event loop until `pred()` or `timeout` seconds (CLI tools and tests)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        app.processEvents()
        if pred():
            return True
        time.sleep(0.01)
    return bool(pred())

