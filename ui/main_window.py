"""The main window: chat on the left; block map, charts and controls on the right; engine state in
the status bar; an error banner with the engine's last log lines and Restart when it fails.

Engine lifecycle: `EngineSource` says whether we spawn the engine (through app.supervisor) or
attach to one (`--connect`). Either way one `EngineLink` worker thread carries all ZeroMQ traffic.
*Engine → Serve OpenAI API…* runs an HTTP front-end for the same engine (ui/api_server.py).

`--connect http://HOST:PORT` (or *Engine → Connect to server…*) watches a server over HTTP
instead: vLLM, SGLang, llama.cpp's server or a KVScope front-end, through one `RemoteLink`
worker thread (ui/remote_link.py). A KVScope server feeds the same block map and charts from its
telemetry stream; the others feed the /metrics charts (ui/remote_charts.py) and an aggregate KV
panel (ui/kv_aggregate.py), which take the block map's and the charts' places.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field

from PySide6.QtCore import QObject, Qt, QTimer, Signal
from PySide6.QtGui import QAction, QActionGroup, QCloseEvent, QKeySequence
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QMainWindow,
    QMessageBox,
    QPlainTextEdit,
    QProgressBar,
    QPushButton,
    QSplitter,
    QStackedWidget,
    QVBoxLayout,
    QWidget,
)

from app.conversations import ConversationStore
from app.load_generator import LoadConfig
from app.remote.probe import METRIC_LABELS, ServerInfo, is_http_url
from app.remote.samples import MetricSample
from app.settings import load_sampling, save_sampling
from app.supervisor import EngineOptions, EngineSupervisor, engine_command
from ui import theme
from ui.api_server import DEFAULT_PORT, OFF, SERVING, WAITING, ApiServer, ApiServerDialog
from ui.block_map import BlockMapWidget
from ui.charts import ChartsWidget
from ui.chat_panel import ChatPanel
from ui.connect_dialog import ConnectDialog, recent_urls, remember_url
from ui.controls import ControlsPanel, LoadPanel
from ui.engine_link import EngineLink
from ui.kv_aggregate import KvAggregateWidget
from ui.metrics_history import MetricsHistory
from ui.remote_charts import MetricsChartsWidget
from ui.remote_link import RemoteLink
from ui.telemetry import HTTP_ORIGIN, Frame, History

log = logging.getLogger(__name__)

STATE_COLOURS = {
    "starting": "#8a909c", "loading": "#f5a623", "ready": "#3cb44b", "busy": "#42d4f4",
    "not answering": "#f58231", "disconnected": "#e6194b", "stopped": "#8a909c",
}
DECODE_WEIGHT_CHOICES = (
    ("auto", "Automatic (4-bit on a CPU, dense on a GPU)",
     "what the app starts with unless told otherwise"),
    ("dense", "Dense (the model's own precision)", "exact; prompts and decode on full weights"),
    ("int4", "4-bit for decode (faster on CPU)",
     "4-bit copies of the linear layers for steps of up to 16 tokens: ~2x faster replies on a "
     "CPU; the default model's own Q4_1 codes, activations in bf16"),
)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "fp8": 1, "int8": 1}
NEEDS_ZMQ = ("needs the engine protocol: this window watches {url} over HTTP (attach to a KVScope "
             "engine with --connect tcp://HOST:PORT to change its limits)")


@dataclass(slots=True)
class EngineSource:
    # attach to this endpoint instead of spawning: tcp://... (an engine), http(s)://... (a
    # server watched over HTTP: ui/remote_link.py), demo://
    connect: str | None = None
    options: EngineOptions = field(default_factory=EngineOptions)
    # Engine command without option flags (tests); `options.to_args()` is appended at start.
    # Default: engine_command(options).
    command: list[str] | None = None
    token: str | None = None
    api_key: str | None = None  # for an http(s):// server (never stored)
    # more keyword arguments for ui.remote_link.RemoteLink (tests: a scripted clock, intervals)
    link_options: dict = field(default_factory=dict)
    stall_timeout: float = 30.0  # one CPU step under load can take seconds
    # the spawned engine runs at a lower CPU priority so that, when the cores are contended
    # (CPU inference), the window stays responsive; 0 = same priority as the GUI
    engine_nice: int = 5


class _SupervisorBridge(QObject):
    """Supervisor callbacks arrive on its reader threads; signals carry them to the GUI thread."""

    progress = Signal(float, str)
    ready = Signal(dict)
    exited = Signal(int)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def kv_formula(model: object) -> str:
    """'KV/token 2·L·H_kv·D·bytes = 2·30·3·64·4 = 46,080 B'."""
    L, H, D = model.num_layers, model.num_kv_heads, model.head_dim  # noqa: N806
    b = DTYPE_BYTES.get(str(model.dtype).replace("torch.", ""))
    if b is None:
        return f"KV/token {model.kv_bytes_per_token:,} B"
    return f"KV/token 2·L·H_kv·D·bytes = 2·{L}·{H}·{D}·{b} = {model.kv_bytes_per_token:,} B"


class MainWindow(QMainWindow):

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
        self._metrics_problem = ""
        # where "back to the local engine" goes: what we were started with, unless it is HTTP
        self._local_connect = None if is_http_url(source.connect) else source.connect
        self.connect_dialog: ConnectDialog | None = None
        self._chat_aliases: dict[str, str] = {}  # chat request id -> its HTTP response id
        self._want_highlight: str | None = None  # a chat not yet resolved to an engine request
        self.supervisor: EngineSupervisor | None = None
        self.welcome = None
        self.last_error = ""
        self._closing = False
        self._frames_seen = 0
        self._bridge: _SupervisorBridge | None = None
        self.engine_endpoint: str | None = None  # where the link connects (what the API fronts)
        self.api = ApiServer(token=source.token,
                             log_file=(data_dir / "api.log") if data_dir else None, parent=self)
        self.api_dialog: ApiServerDialog | None = None
        self.api_error_box: QMessageBox | None = None
        self._http_in_flight = 0
        # seconds spent in the GUI thread's own handlers (the latency benchmark reports them)
        self.perf: dict[str, collections.deque[float]] = {
            k: collections.deque(maxlen=10_000) for k in ("refresh", "frames", "replies")}
        self.setWindowTitle("KVScope")

        self.chat = ChatPanel(store, load_sampling(settings))
        self.block_map = BlockMapWidget()
        self.charts = ChartsWidget()
        self.kv_aggregate = KvAggregateWidget()
        self.metric_charts = MetricsChartsWidget()
        self.controls = ControlsPanel()
        self.load_panel = LoadPanel()
        self._build_layout()
        self._build_status_bar()
        self._build_menu()

        self.chat.submit.connect(self._on_submit)
        self.chat.abort.connect(self._on_abort)
        self.chat.conversation_selected.connect(self._on_conversation_selected)
        self.block_map.request_selected.connect(self._on_block_request_selected)
        self.controls.control.connect(self._on_control)
        self.load_panel.start.connect(self.start_load)
        self.load_panel.stop.connect(lambda: self.link and self.link.stop_load())
        self.api.state_changed.connect(self._on_api_state)
        self.api.failed.connect(self._on_api_failed)
        self.api.restarted.connect(lambda ep: log.info("API server restarted against %s", ep))

        # charts and block map redraw on alternate ticks: each at refresh_hz, and no single
        # event does both (shorter events = lower event-loop latency)
        self._tick = 0
        self.timer = QTimer(self)
        self.timer.setInterval(max(1, int(500 / refresh_hz)))
        self.timer.timeout.connect(self._refresh)
        self.timer.start()
        self._restore_geometry()

    # --- layout ----------------------------------------------------------------------------
    def _build_layout(self) -> None:
        self.banner = QFrame()
        self.banner.setObjectName("banner")
        self.banner.setStyleSheet("QFrame#banner { background: #4a1f24; border-radius: 4px; }")
        bl = QVBoxLayout(self.banner)
        bl.setContentsMargins(8, 6, 8, 6)
        row = QHBoxLayout()
        self.banner_text = QLabel()
        self.banner_text.setWordWrap(True)
        self.banner_text.setStyleSheet("color: #ffd6d6; font-weight: bold;")
        self.restart_btn = QPushButton("Restart engine")
        self.restart_btn.clicked.connect(self.restart_engine)
        self.log_btn = QPushButton("Show log")
        self.log_btn.setCheckable(True)
        row.addWidget(self.banner_text, 1)
        row.addWidget(self.log_btn)
        row.addWidget(self.restart_btn)
        bl.addLayout(row)
        self.banner_log = QPlainTextEdit()
        self.banner_log.setReadOnly(True)
        self.banner_log.setFont(theme.mono_font(8))
        self.banner_log.setMaximumHeight(160)
        self.banner_log.setVisible(False)
        self.log_btn.toggled.connect(self.banner_log.setVisible)
        bl.addWidget(self.banner_log)
        self.banner.setVisible(False)

        bottom = QWidget()
        bot = QHBoxLayout(bottom)
        bot.setContentsMargins(0, 0, 0, 0)
        bot.addWidget(self.controls, 3)
        bot.addWidget(self.load_panel, 2)

        # per-block views, or (servers without per-block telemetry) the aggregate ones
        self.kv_stack = QStackedWidget()
        self.kv_stack.addWidget(self.block_map)
        self.kv_stack.addWidget(self.kv_aggregate)
        self.chart_stack = QStackedWidget()
        self.chart_stack.addWidget(self.charts)
        self.chart_stack.addWidget(self.metric_charts)
        right = QSplitter(Qt.Orientation.Vertical)
        right.addWidget(self.kv_stack)
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
        menu = self.menuBar().addMenu("&Engine")
        restart = self.restart_action = QAction("&Restart engine", self)
        restart.setShortcut(QKeySequence("Ctrl+Shift+R"))
        restart.triggered.connect(self.restart_engine)
        menu.addAction(restart)
        connect = self.connect_action = QAction("&Connect to server…", self)
        connect.setToolTip("watch a vLLM, SGLang, llama.cpp or KVScope server over HTTP")
        connect.triggered.connect(self.open_connect_dialog)
        menu.addAction(connect)
        local = self.local_action = QAction("Back to the &local engine", self)
        local.setToolTip("stop watching the server and use this window's own engine again")
        local.triggered.connect(self.use_local_engine)
        local.setVisible(self._is_remote())
        menu.addAction(local)
        menu.addSeparator()
        weights = self.decode_weights_menu = menu.addMenu("&Decode weights")
        group = QActionGroup(self)
        self.decode_weight_actions: dict[str, QAction] = {}
        for value, label, tip in DECODE_WEIGHT_CHOICES:
            action = QAction(label, self, checkable=True)
            action.setToolTip(tip)
            action.setData(value)
            group.addAction(action)
            weights.addAction(action)
            self.decode_weight_actions[value] = action
        weights.setToolTipsVisible(True)
        current = self.source.options.decode_weights or "dense"
        actions = self.decode_weight_actions
        actions.get(current, actions["dense"]).setChecked(True)
        group.triggered.connect(lambda a: self.set_decode_weights(a.data()))
        menu.addSeparator()
        api = self.api_action = QAction("Serve &OpenAI API…", self, checkable=True)
        api.triggered.connect(self._on_api_toggled)
        menu.addAction(api)
        menu.setToolTipsVisible(True)
        self._update_menu()

    def _update_menu(self) -> None:
        """What the Engine menu offers depends on what the window is attached to."""
        remote = self._is_remote()
        weights, api = self.decode_weights_menu, self.api_action
        weights.setEnabled(not self.source.connect)
        weights.setToolTip(
            "" if not self.source.connect else
            "set when the engine starts; this window watches a server over HTTP" if remote else
            "set when the engine starts; this window attached to a running one")
        api.setEnabled(not remote and not self._is_demo())
        api.setToolTip("the window is watching a server over HTTP; it has an API of its own"
                       if remote else
                       "an OpenAI-compatible HTTP API on 127.0.0.1 for this window's engine")
        self.restart_action.setText("&Reconnect" if remote else "&Restart engine")
        self.local_action.setVisible(remote)

    def set_decode_weights(self, value: str) -> None:
        """Remember the choice and restart a spawned engine with it (an attached engine keeps
        whatever it was started with)."""
        if value not in self.decode_weight_actions:
            raise ValueError(f"decode weights must be one of {list(self.decode_weight_actions)}")
        previous = self.source.options.decode_weights or "dense"
        if value == previous:
            self.decode_weight_actions[value].setChecked(True)
            return
        in_flight = len(self.chat.active)
        if in_flight and not self.source.connect and not self._confirm_restart(in_flight):
            self.decode_weight_actions[previous].setChecked(True)
            return
        self.decode_weight_actions[value].setChecked(True)
        self.source.options.decode_weights = value
        self.settings.setValue("engine/decode_weights", value)
        if self.source.connect:
            self.statusBar().showMessage(
                "decode weights apply to engines this app starts; the attached one is unchanged",
                8000,
            )
            return
        self.restart_engine()

    def _confirm_restart(self, in_flight: int) -> bool:
        answer = QMessageBox.question(
            self, "Restart the engine",
            f"Changing the decode weights restarts the engine: {in_flight} reply(s) in progress "
            "will stop (the text so far is kept). Restart now?")
        return answer == QMessageBox.StandardButton.Yes

    # --- OpenAI-compatible API ---------------------------------------------------------------
    def _is_demo(self) -> bool:
        return bool(self.source.connect and self.source.connect.startswith("demo:"))

    def _is_remote(self) -> bool:
        """Watching a server over HTTP (not an engine over ZeroMQ)."""
        return is_http_url(self.source.connect)

    # --- a server over HTTP --------------------------------------------------------------------
    def open_connect_dialog(self) -> None:
        dialog = ConnectDialog(recent_urls(self.settings), self)
        dialog.accepted.connect(self._on_connect_dialog_accepted)
        dialog.finished.connect(dialog.deleteLater)
        self.connect_dialog = dialog
        dialog.open()  # window-modal, returns at once

    def _on_connect_dialog_accepted(self) -> None:
        dialog = self.sender()
        if dialog is not self.connect_dialog:
            return
        self.connect_dialog = None
        url, key = dialog.values()
        self.connect_to(url, key)

    def connect_to(self, url: str, api_key: str | None = None) -> None:
        """Watch the server at `url` (remembered in the recent list; the key is not)."""
        remember_url(self.settings, url)
        if self.api.state != OFF:
            self.api.stop()  # it fronted our own engine, which we are leaving
        self.source.connect, self.source.api_key = url, api_key
        self._update_menu()
        self.restart_engine()

    def use_local_engine(self) -> None:
        self.source.connect, self.source.api_key = self._local_connect, None
        self._update_menu()
        self.restart_engine()

    def _on_remote_connected(self, info: ServerInfo) -> None:
        if self.sender() is not self.link:
            return
        previous = self.remote_info
        if previous is not None and info.per_block and info.welcome is not previous.welcome:
            # the server came back with another engine: its counters and blocks start over
            self.history.clear()
            self.charts.clear()
            self.block_map.clear()
        self.remote_info = info
        self.progress.setVisible(False)
        self.progress_text.setText("")
        per_block = info.per_block
        self.kv_stack.setCurrentWidget(self.block_map if per_block else self.kv_aggregate)
        self.chart_stack.setCurrentWidget(self.charts if per_block else self.metric_charts)
        if per_block:
            self.welcome = info.welcome
            self._show_model(info.welcome)
            self.model_label.setText(f"{self.model_label.text()} · KVScope at {info.url}")
            self.controls.show_config(_cfg_dict(info.welcome.config))
        else:
            self.welcome = None
            self.kv_aggregate.set_server(info.kind)
            self._show_remote(info)
        self._show_remote_notes()
        self._set_controls_remote(info.url)
        self.load_panel.setEnabled(True)
        self.chat.set_engine_ready(True)
        if self.state not in ("ready", "busy"):
            self.banner.setVisible(False)
            self._set_state("ready")

    def _on_remote_connect_failed(self, why: str) -> None:
        if self.sender() is self.link:  # not a late word from a link we have replaced
            self._fail(f"could not connect: {why}")

    def _show_remote(self, info: ServerInfo) -> None:
        bits = [info.name]
        if info.model:
            bits.append(info.model)
        bits.append(info.url)
        s = self.metric_history.latest
        ranks = [r for r in s.ranks if r] if s is not None else []
        if len(ranks) > 1:
            bits.append(f"{len(ranks)} ranks")
        self.model_label.setText(" · ".join(bits))
        if s is not None and s.num_blocks:
            bs = f" × {s.block_size} tokens" if s.block_size else ""
            kv = f"{s.num_blocks:,} blocks{bs} per rank · KV usage only (no per-block telemetry)"
        elif s is not None and s.capacity_tokens:
            kv = f"{s.capacity_tokens:,.0f} KV tokens per rank · usage only"
        else:
            kv = "KV pool size not reported"
        self.kv_label.setText(kv)

    def _show_remote_notes(self) -> None:
        """What the server does not report, and why /metrics could not be read (if so)."""
        info = self.remote_info
        if info is None:
            self.remote_label.setVisible(False)
            return
        parts = []
        if self._metrics_problem:
            parts.append(f"metrics: {self._metrics_problem}")
        if not info.per_block:
            missing = _missing_labels(info.missing)
            if missing:
                parts.append("not reported by this server: " + ", ".join(missing))
        text = " · ".join(parts)
        if text != self.remote_label.text():
            self.remote_label.setText(text)
        self.remote_label.setVisible(bool(text))

    def _on_metrics(self, sample: MetricSample) -> None:
        if self.sender() is not self.link:
            return
        t0 = time.perf_counter()
        first = self.metric_history.latest is None
        self.metric_history.add(sample)
        self.kv_aggregate.set_sample(sample)
        if first and self.remote_info is not None and not self.remote_info.per_block:
            self._show_remote(self.remote_info)  # ranks and pool size come with the first one
        if self.state in ("ready", "busy"):
            running, waiting = sample.running or 0, sample.waiting or 0
            self._set_state("busy" if running or waiting else "ready",
                            f"{running:.0f} running, {waiting:.0f} waiting" if running or waiting
                            else "")
        self.perf["frames"].append(time.perf_counter() - t0)

    def _on_metrics_problem(self, why: str) -> None:
        if self.sender() is not self.link:
            return
        self._metrics_problem = why
        self._show_remote_notes()

    def _set_controls_remote(self, url: str | None) -> None:
        """Engine controls need the ZeroMQ protocol: greyed out, with the reason, over HTTP
        (`url`); None puts the engine's own tooltips back (enabled once an engine connects)."""
        tip = NEEDS_ZMQ.format(url=url) if url else ""
        if url:
            self.controls.setEnabled(False)
        self.controls.setToolTip(tip)
        for w in (*self.controls.sliders.values(), self.controls.prefix, self.controls.flush):
            w.setProperty("engine_tip", w.property("engine_tip") or w.toolTip())
            w.setToolTip(tip or w.property("engine_tip"))
        self.controls.show_result(
            "engine controls: only over the engine protocol (ZeroMQ)" if url else "")

    def _on_abort(self, rid: str) -> None:
        if self.link is not None:
            self.link.abort(rid)

    def _on_api_toggled(self, checked: bool) -> None:
        """The menu action (user-triggered only): on asks for port and key first."""
        if not checked:
            self.api.stop()
            return
        try:
            port = int(self.settings.value("api/port", DEFAULT_PORT))
        except (TypeError, ValueError):
            port = DEFAULT_PORT
        dialog = ApiServerDialog(port if 0 <= port <= 65535 else DEFAULT_PORT, self)
        dialog.accepted.connect(self._on_api_dialog_accepted)
        dialog.rejected.connect(self._on_api_dialog_rejected)
        dialog.finished.connect(dialog.deleteLater)
        self.api_dialog = dialog
        dialog.open()  # window-modal, returns at once: the event loop keeps running

    def _on_api_dialog_accepted(self) -> None:
        dialog = self.sender()
        if dialog is not self.api_dialog:
            return
        port, key = dialog.values()
        self.api_dialog = None
        self.settings.setValue("api/port", port)  # never the key
        self.api.start(port, key)

    def _on_api_dialog_rejected(self) -> None:
        if self.sender() is self.api_dialog:
            self.api_dialog = None
            self.api_action.setChecked(self.api.wanted)

    def _on_api_state(self, state: str) -> None:
        self.api_action.setChecked(self.api.wanted)
        self._http_in_flight = self._count_http()
        self._show_api()

    def _on_api_failed(self, why: str, tail: list[str]) -> None:
        self.api_action.setChecked(False)
        box = QMessageBox(QMessageBox.Icon.Warning, "Serve OpenAI API", why + ".",
                          QMessageBox.StandardButton.Ok, self)
        if tail:
            box.setInformativeText("\n".join(tail[-6:]))
        box.finished.connect(box.deleteLater)
        self.api_error_box = box
        box.open()  # not exec(): nothing waits on the user

    def _count_http(self) -> int:
        latest = self.history.latest
        if latest is None:
            return 0
        return sum(1 for r in latest.requests
                   if r.origin == HTTP_ORIGIN and r.status != "finished")

    def _show_api(self) -> None:
        state = self.api.state
        if state == SERVING:
            text = f"API {self.api.url}/v1 · {self._http_in_flight} HTTP in flight"
        elif state == WAITING:
            text = "API: waiting for the engine"
        elif self.api.restarting:
            moved = self.api.endpoint != self.api.served_endpoint
            text = "API restarting for the new engine…" if moved else "API restarting…"
        else:
            text = f"API {state}…"
        self.api_label.setText(text)
        self.api_label.setVisible(state != OFF)

    def _build_status_bar(self) -> None:
        sb = self.statusBar()
        self.state_label = QLabel()
        self.progress = QProgressBar()
        self.progress.setMaximumWidth(180)
        self.progress.setRange(0, 100)
        self.progress.setVisible(False)
        self.progress_text = QLabel()
        self.model_label = QLabel()
        self.kv_label = QLabel()
        self.kv_label.setStyleSheet(f"color: {theme.MUTED};")
        self.api_label = QLabel()
        self.api_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.api_label.setStyleSheet(f"color: {theme.ACCENT}; margin-left: 8px;")
        self.api_label.setToolTip("the OpenAI-compatible API (Engine → Serve OpenAI API…) and "
                                  "how many of the engine's requests came through it")
        self.api_label.setVisible(False)
        self.remote_label = QLabel()
        self.remote_label.setStyleSheet("color: #f5a623; margin-left: 8px;")
        self.remote_label.setWordWrap(False)
        self.remote_label.setToolTip("what this server's /metrics does not export: those charts "
                                     "say \"not reported by this server\" instead of showing 0")
        self.remote_label.setVisible(False)
        sb.addWidget(self.state_label)
        sb.addWidget(self.progress)
        sb.addWidget(self.progress_text)
        sb.addWidget(self.model_label)
        sb.addWidget(self.api_label)
        sb.addWidget(self.remote_label)
        sb.addPermanentWidget(self.kv_label)
        self._set_state("starting")

    def _set_state(self, state: str, detail: str = "") -> None:
        self.state = state
        col = STATE_COLOURS.get(state, theme.TEXT)
        self.state_label.setText(f'<b style="color:{col}">● {state}</b>'
                                 + (f" {detail}" if detail else ""))

    def _show_model(self, w) -> None:
        m = w.model
        engine_bits = [m.name, m.architecture, m.device, m.dtype]
        if m.attention_backend:
            engine_bits.append(f"{m.attention_backend} attention")
        if m.decode_weights == "int4":
            engine_bits.append("int4 decode weights")
        if m.cuda_graph_sizes:
            engine_bits.append(f"CUDA graphs ≤{m.cuda_graph_sizes[-1]} seqs")
        self.model_label.setText(" · ".join(engine_bits))
        total = m.num_blocks * m.block_size * m.kv_bytes_per_token
        self.kv_label.setText(
            f"{m.num_blocks:,} blocks × {m.block_size} tokens · {kv_formula(m)} · "
            f"KV pool {human_bytes(total)} · max len {m.max_model_len:,}")

    # --- engine lifecycle -------------------------------------------------------------------
    def start_engine(self) -> None:
        # the per-block views until a server over HTTP turns out to have none
        self.remote_info = None
        self._metrics_problem = ""
        self._show_remote_notes()
        self.kv_stack.setCurrentWidget(self.block_map)
        self.chart_stack.setCurrentWidget(self.charts)
        self._set_controls_remote(self.source.connect if self._is_remote() else None)
        self.banner.setVisible(False)
        self.chat.set_engine_ready(False, "starting the engine…")
        self.restart_btn.setText("Reconnect" if self._is_remote() else "Restart engine")
        if self.source.connect:
            self._set_state("starting", f"connecting to {self.source.connect}")
            self._open_link(self.source.connect)
            return
        self._set_state("loading")
        self.progress.setVisible(True)
        self.progress.setValue(0)
        bridge = _SupervisorBridge()
        bridge.progress.connect(self._on_progress)
        bridge.ready.connect(self._on_engine_ready)
        bridge.exited.connect(self._on_engine_exited)
        self._bridge = bridge
        # A fixed command (tests, --connect-less custom set-ups) still takes the options' flags:
        # argparse lets the later copy of a flag win.
        if self.source.command:
            cmd = [*self.source.command, *self.source.options.to_args()]
        else:
            cmd = engine_command(self.source.options)
        log_file = (self.data_dir / "engine.log") if self.data_dir else None
        sup = EngineSupervisor(
            cmd,
            on_progress=lambda f, m, b=bridge: b.progress.emit(f, m),
            on_ready=lambda info, b=bridge: b.ready.emit(info),
            on_exit=lambda code, b=bridge: b.exited.emit(code),
            log_file=log_file,
            nice=self.source.engine_nice,
        )
        self.supervisor = sup
        try:
            sup.start()
        except OSError as exc:
            self._fail(f"could not start the engine: {exc}")

    def _on_progress(self, frac: float, msg: str) -> None:
        if self.sender() is not self._bridge:
            return  # a previous engine's late line
        self.progress.setVisible(True)
        self.progress.setValue(int(frac * 100))
        self.progress_text.setText(msg)
        self.chat.set_engine_ready(False, f"loading the engine: {msg} ({frac * 100:.0f}%)")

    def _on_engine_ready(self, info: dict) -> None:
        if self.sender() is not self._bridge:
            return
        self.progress_text.setText("connecting…")
        self._open_link(info["endpoint"])

    def _open_link(self, endpoint: str) -> None:
        if is_http_url(endpoint):
            self._open_remote(endpoint)
            return
        if endpoint.startswith("demo:"):
            from ui.demo import DemoLink

            link = DemoLink()
        else:
            link = EngineLink(endpoint, token=self.source.token,
                              stall_timeout=self.source.stall_timeout)
            self.engine_endpoint = endpoint
            self.api.set_endpoint(endpoint)  # (re)starts the HTTP server when it is on
        link.connected.connect(self._on_connected)
        link.connect_failed.connect(lambda why: self._fail(f"could not connect: {why}"))
        link.replies.connect(self._on_replies)
        link.frames.connect(self._on_frames)
        link.control_reply.connect(self._on_control_reply)
        link.load_stats.connect(self.load_panel.show_stats)
        link.stalled.connect(self._on_stalled)
        link.recovered.connect(self._on_recovered)
        link.goodbye.connect(self._on_goodbye)
        self.link = link
        link.start()

    def _open_remote(self, url: str) -> None:
        try:
            options = {"stall_timeout": min(self.source.stall_timeout, 10.0),
                       **self.source.link_options}
            link = RemoteLink(url, api_key=self.source.api_key, **options)
        except ValueError as exc:
            self._fail(str(exc))
            return
        link.connected.connect(self._on_remote_connected)
        link.connect_failed.connect(self._on_remote_connect_failed)
        link.replies.connect(self._on_replies)
        link.frames.connect(self._on_frames)
        link.metrics.connect(self._on_metrics)
        link.metrics_problem.connect(self._on_metrics_problem)
        link.alias.connect(self._on_alias)
        link.control_reply.connect(self._on_control_reply)
        link.load_stats.connect(self.load_panel.show_stats)
        link.stalled.connect(self._on_stalled)
        link.recovered.connect(self._on_recovered)
        self.link = link
        link.start()

    def _on_connected(self, welcome) -> None:
        if self.sender() is not self.link:
            return
        self.welcome = welcome
        self.progress.setVisible(False)
        self.progress_text.setText("")
        self._show_model(welcome)
        self._set_controls_remote(None)
        self.controls.setEnabled(True)
        self.controls.show_config(_cfg_dict(welcome.config))
        self.load_panel.setEnabled(True)
        self.chat.set_engine_ready(True)
        self.banner.setVisible(False)
        self._set_state("ready")

    def _on_replies(self, msgs: list) -> None:
        t0 = time.perf_counter()
        self.chat.on_replies(msgs)
        self.perf["replies"].append(time.perf_counter() - t0)

    def _on_frames(self, frames: list[Frame]) -> None:
        if self.sender() is not self.link:
            return
        t0 = time.perf_counter()
        self._take_frames(frames)
        self.perf["frames"].append(time.perf_counter() - t0)

    def _take_frames(self, frames: list[Frame]) -> None:
        for f in frames:
            self.history.add(f)
        self._frames_seen += len(frames)
        last = frames[-1]
        self.block_map.set_frame(last, self.history.last_tables)
        if self._want_highlight is not None:
            erid = self._engine_rid(self._want_highlight)
            if erid is not None and erid != self.block_map.highlight_rid:
                self.block_map.highlight_rid = erid  # drawn with this frame
        self.controls.show_config(last.config)
        if self.api.state == SERVING:
            n = self._count_http()
            if n != self._http_in_flight:  # setText re-lays the status bar out: only on change
                self._http_in_flight = n
                self._show_api()
        if self.state in ("ready", "busy"):
            running = last.counters.get("num_requests_running", 0)
            waiting = last.counters.get("num_requests_waiting", 0)
            self._set_state("busy" if running or waiting else "ready",
                            f"{running:.0f} running, {waiting:.0f} waiting" if running or waiting
                            else "")

    def _refresh(self) -> None:
        t0 = time.perf_counter()
        self._tick += 1
        aggregate = self.kv_stack.currentWidget() is self.kv_aggregate
        if self._tick % 2:
            if aggregate:
                self.metric_charts.refresh(self.metric_history)
            else:
                self.charts.refresh(self.history)
        elif aggregate:
            self.kv_aggregate.redraw()
        else:
            self.block_map.redraw()
        self.perf["refresh"].append(time.perf_counter() - t0)

    def redraw_now(self) -> None:
        """Both panels at once (screenshots)."""
        if self.kv_stack.currentWidget() is self.kv_aggregate:
            self.metric_charts.refresh(self.metric_history)
            self.kv_aggregate.redraw(force=True)
            return
        self.charts.refresh(self.history)
        self.block_map.redraw(force=True)

    def _on_exit_guard(self) -> bool:
        return self._closing or (self.supervisor is not None and self.supervisor.stopping)

    def _on_engine_exited(self, code: int) -> None:
        if self.sender() is not self._bridge or self._on_exit_guard():
            return
        self._fail(f"the engine exited with code {code}")

    def _on_stalled(self, why: str) -> None:
        if self.sender() is not self.link:
            return
        if self.supervisor is not None and not self.supervisor.running():
            return  # the exit handler says it better
        self._set_state("not answering", why)
        if self._is_remote():  # the link keeps trying; a restarted server is picked up again
            self._show_banner(f"The server at {self.source.connect} is not answering ({why}). "
                              "Trying again every second; replies in progress are cut off.")
            return
        self._show_banner(f"The engine is not answering ({why}). It may be busy with a long "
                          "step; Restart stops it and starts a new one.")
        if self.supervisor is None:  # attached: nobody will tell us it died, so give up later
            link = self.link
            QTimer.singleShot(int(self.source.stall_timeout * 1000),
                              lambda: self._give_up_on(link))

    def _give_up_on(self, link) -> None:
        if link is self.link and self.state == "not answering":
            self._fail("the engine stopped answering")

    def _on_recovered(self) -> None:
        if self.sender() is not self.link or self.state != "not answering":
            return
        self.banner.setVisible(False)
        self._set_state("ready")

    def _on_goodbye(self, reason: str) -> None:
        if self.sender() is not self.link or self._on_exit_guard():
            return
        self._fail(f"the engine shut down: {reason}")

    def _fail(self, why: str) -> None:
        """The engine is gone: stay responsive, keep every reply, offer Restart."""
        self.last_error = why
        log.warning("engine failure: %s", why)
        self.chat.interrupt_all("interrupted: engine stopped")
        self.chat.set_engine_ready(False, "engine unavailable: your messages are saved")
        self.controls.setEnabled(False)
        self.load_panel.set_running(False)
        self.load_panel.setEnabled(False)
        self.progress.setVisible(False)
        self.progress_text.setText("")
        if self.link is not None:
            self.link.stop(timeout=1.0)
            self.link = None
        self._set_state("disconnected", why)
        if self._is_remote():
            self._show_banner(f"Cannot watch {self.source.connect}: {why}.")
        else:
            self._show_banner(f"Engine failure: {why}.")

    def _show_banner(self, text: str) -> None:
        tail = self.supervisor.tail(40) if self.supervisor else []
        self.banner_text.setText(text + (" Last lines of its log below." if tail else ""))
        self.banner_log.setPlainText("\n".join(tail) if tail else "(no engine log: attached "
                                     "with --connect)")
        self.banner_log.setVisible(bool(tail))
        self.log_btn.setChecked(bool(tail))
        self.banner.setVisible(True)

    def restart_engine(self) -> None:
        self.chat.interrupt_all("interrupted: engine restarted")
        if self.link is not None:
            self.link.stop(timeout=1.0)
            self.link = None
        if self.supervisor is not None:
            self.supervisor.stop(timeout=3.0)
            self.supervisor = None
        self._bridge = None
        self.history.clear()
        self.charts.clear()
        self.block_map.clear()
        self.metric_history.clear()
        self.metric_charts.clear()
        self.kv_aggregate.clear()
        self._chat_aliases.clear()
        self.load_panel.set_running(False)
        self.start_engine()

    # --- requests and controls --------------------------------------------------------------
    def _on_submit(self, rid: str, messages: list, sampling: dict) -> None:
        if self.link is None:
            self.chat.interrupt_all("no engine")
            return
        self.link.generate(rid, messages, sampling)

    def _on_conversation_selected(self, conv_id: str, rid: str) -> None:
        if self._is_remote() and rid:
            # a chat over HTTP has another id in the engine: found once the server names it
            self._want_highlight = rid
            self.block_map.highlight_request(self._engine_rid(rid))
            return
        self._want_highlight = None
        self.block_map.highlight_request(rid or None)

    def _on_alias(self, rid: str, response_id: str) -> None:
        if self.sender() is self.link:
            self._chat_aliases[rid] = response_id

    def _engine_rid(self, rid: str) -> str | None:
        """The engine's id of a chat sent over HTTP (a KVScope front-end names its engine
        request after the response id: "<chatcmpl-...>-<suffix>"); None while unknown."""
        alias = self._chat_aliases.get(rid)
        if alias is None:
            return None
        latest = self.history.latest
        live = [r.request_id for r in latest.requests] if latest is not None else []
        for erid in (*live, *self.history.last_tables):
            if erid == alias or erid.startswith(alias + "-"):
                return erid
        return None

    def _chat_rid_of(self, engine_rid: str) -> str:
        for rid, alias in self._chat_aliases.items():
            if engine_rid == alias or engine_rid.startswith(alias + "-"):
                return rid
        return engine_rid

    def _on_block_request_selected(self, rid: str) -> None:
        """A request picked in the block map: show its conversation when it is one of ours."""
        self._want_highlight = None
        if self._is_remote():
            rid = self._chat_rid_of(rid)
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

    def _on_control_reply(self, msg) -> None:
        if type(msg).__name__ == "ControlAck":
            self.controls.show_config(_cfg_dict(msg.config))
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

    # --- settings and shutdown --------------------------------------------------------------
    def _restore_geometry(self) -> None:
        for key, box in self.load_panel.boxes().items():
            try:
                box.setValue(int(self.settings.value(f"load/{key}", box.value())))
            except (TypeError, ValueError):
                pass
        geo = self.settings.value("window/geometry")
        if geo is not None:
            self.restoreGeometry(geo)
        else:
            self.resize(1600, 1000)
        for key, split in (("window/main_split", self.main_split),
                           ("window/right_split", self.right_split)):
            state = self.settings.value(key)
            if state is not None:
                split.restoreState(state)

    def save_settings(self) -> None:
        self.settings.setValue("window/geometry", self.saveGeometry())
        self.settings.setValue("window/main_split", self.main_split.saveState())
        self.settings.setValue("window/right_split", self.right_split.saveState())
        save_sampling(self.settings, self.chat.sampling())
        for key, box in self.load_panel.boxes().items():
            self.settings.setValue(f"load/{key}", box.value())
        if self.chat.current is not None:
            self.settings.setValue("chat/current", self.chat.current.id)
        self.settings.sync()

    def shutdown(self) -> None:
        """Save everything, close the link, stop a spawned engine. Idempotent."""
        if self._closing:
            return
        self._closing = True
        self.timer.stop()
        self.chat.shutdown()
        self.save_settings()
        if self.link is not None:
            self.link.stop(timeout=2.0)
            self.link = None
        self.api.shutdown()
        if self.supervisor is not None:
            self.supervisor.stop(timeout=5.0)
        self._set_state("stopped")

    def closeEvent(self, ev: QCloseEvent) -> None:  # noqa: N802 - Qt name
        self.shutdown()
        super().closeEvent(ev)


def _missing_labels(missing: list[str]) -> list[str]:
    """Canonical metric names -> what the status bar says (hits and queries as one)."""
    out = []
    for name in missing:
        label = METRIC_LABELS.get(name, name)
        if name in ("prefix_queries", "prefix_hits"):
            label = "prefix-cache hit rate"
        if label not in out:
            out.append(label)
    return out


def _cfg_dict(cfg) -> dict:
    fields = getattr(cfg, "__struct_fields__", None)
    return {k: getattr(cfg, k) for k in fields} if fields else dict(cfg)


def wait_until(pred, timeout: float, app) -> bool:
    """Spin the event loop until `pred()` or `timeout` seconds (CLI tools and tests)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        app.processEvents()
        if pred():
            return True
        time.sleep(0.01)
    return bool(pred())


