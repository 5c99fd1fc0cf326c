"""Live engine controls: scheduler limits (applied while the engine runs), the prefix-caching
switch and "flush prefix cache". Also the load-generator panel."""

from __future__ import annotations

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QGridLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QSlider,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from app.load_generator import LoadConfig
from ui import theme

# (name, label, minimum, maximum, step, tooltip)
LIMITS = (
    ("max_num_seqs", "max batch (seqs)", 1, 256, 1,
     "max_num_seqs: how many requests may run in one step"),
    ("max_num_batched_tokens", "token budget / step", 16, 8192, 16,
     "max_num_batched_tokens: prompt + decode tokens computed per step"),
    ("long_prefill_chunk", "prefill chunk", 0, 4096, 16,
     "long_prefill_chunk: the most prompt tokens one request may take per step (0 = no limit). "
     "Until set here: 512 while other requests run, and a prompt alone takes the whole budget"),
)
AUTO_CHUNK_TIP = ("the engine's own rule: 512 prompt tokens per step while other requests run, "
                  "the whole token budget for a prompt alone")


def config_dict(cfg) -> dict:
    """An engine's live config (a protocol struct, or a dict already) as `show_config` takes it."""
    fields = getattr(cfg, "__struct_fields__", None)
    return {k: getattr(cfg, k) for k in fields} if fields else dict(cfg)


class ControlsPanel(QGroupBox):
    control = Signal(str, dict)  # op, fields (ipc.protocol.Control)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("Engine controls", parent)
        self.sliders: dict[str, QSlider] = {}
        self.values: dict[str, QLabel] = {}
        self._pending: dict[str, int] = {}
        self._pending_default_chunk = False  # "auto" clicked, the engine not yet there
        grid = QGridLayout(self)
        grid.setContentsMargins(6, 12, 6, 6)
        grid.setVerticalSpacing(3)
        for row, (name, label, lo, hi, step, tip) in enumerate(LIMITS):
            s = QSlider(Qt.Orientation.Horizontal)
            s.setRange(lo // step, hi // step)
            s.setProperty("step", step)
            s.setToolTip(tip)
            s.valueChanged.connect(lambda v, n=name: self._on_slider(n, v))
            lab = QLabel(label)
            lab.setToolTip(tip)
            val = QLabel("—")
            val.setMinimumWidth(44)
            val.setAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
            grid.addWidget(lab, row, 0)
            grid.addWidget(s, row, 1)
            grid.addWidget(val, row, 2)
            self.sliders[name], self.values[name] = s, val
        # the prefill chunk's way back to the engine's rule once the slider has set a number
        self.auto_chunk = QCheckBox("auto")
        self.auto_chunk.setToolTip(AUTO_CHUNK_TIP)
        self.auto_chunk.clicked.connect(self._on_auto_chunk)
        chunk_row = [n for n, *_ in LIMITS].index("long_prefill_chunk")
        grid.addWidget(self.auto_chunk, chunk_row, 3)
        self.prefix = QCheckBox("prefix caching")
        self.prefix.setToolTip("reuse the KV of earlier requests with the same token prefix")
        self.prefix.clicked.connect(
            lambda on: self.control.emit("set_prefix_caching", {"enable_prefix_caching": on}))
        self.flush = QPushButton("Flush prefix cache")
        self.flush.setToolTip("drop every cached (unreferenced) block's hash")
        self.flush.clicked.connect(lambda: self.control.emit("reset_prefix_cache", {}))
        row = QHBoxLayout()
        row.addWidget(self.prefix)
        row.addStretch(1)
        row.addWidget(self.flush)
        grid.addLayout(row, len(LIMITS), 0, 1, 4)
        self.status = QLabel("")
        self.status.setStyleSheet(f"color: {theme.MUTED}; font-size: 8pt;")
        grid.addWidget(self.status, len(LIMITS) + 1, 0, 1, 4)
        self._debounce = QTimer(self)
        self._debounce.setSingleShot(True)
        self._debounce.setInterval(150)
        self._debounce.timeout.connect(self._apply)
        self.setEnabled(False)

    def _on_slider(self, name: str, v: int) -> None:
        value = v * int(self.sliders[name].property("step"))
        self.values[name].setText(str(value))
        if self.signalsBlocked():
            return
        if name == "long_prefill_chunk":  # a number of one's own from now on
            self.auto_chunk.setChecked(False)
            self._pending_default_chunk = False
        self._pending[name] = value
        self._debounce.start()

    def _on_auto_chunk(self, on: bool) -> None:
        """Checked: back to the engine's rule; unchecked: keep the number the slider shows."""
        self._pending.pop("long_prefill_chunk", None)
        self._pending_default_chunk = on
        if on:
            self.status.setText("applying the default prefill chunk")
            self.control.emit("set_limits", {"default_prefill_chunk": True})
        else:
            self._on_slider("long_prefill_chunk", self.sliders["long_prefill_chunk"].value())

    def set_limit(self, name: str, value: int) -> None:
        """Move a slider as a user would (tests, keyboard); applies after the debounce."""
        step = int(self.sliders[name].property("step"))
        self.sliders[name].setValue(value // step)

    def _apply(self) -> None:
        if self._pending:
            fields, self._pending = dict(self._pending), {}
            self.status.setText("applying " + ", ".join(f"{k}={v}" for k, v in fields.items()))
            self.control.emit("set_limits", fields)

    def show_config(self, cfg: dict) -> None:
        """The engine's live config (telemetry or a control ack): move the widgets to it."""
        default_chunk = bool(cfg.get("long_prefill_chunk_default", False))
        if default_chunk:
            self._pending_default_chunk = False
        waiting = {"long_prefill_chunk"} if self._pending_default_chunk else set()
        skip = self._pending.keys() | waiting  # changes on their way to the engine
        for name, s in self.sliders.items():
            if name in cfg and name not in skip and not s.isSliderDown():
                step = int(s.property("step"))
                value = int(cfg[name])
                s.blockSignals(True)
                s.setValue(value // step)
                s.blockSignals(False)
                self.values[name].setText(str(value))
        if "enable_prefix_caching" in cfg:
            self.prefix.setChecked(bool(cfg["enable_prefix_caching"]))
        if "long_prefill_chunk" not in skip:
            self.auto_chunk.setChecked(default_chunk)

    def show_result(self, text: str, error: bool = False) -> None:
        if error:  # a refused change: the next config shows what the engine runs
            self._pending_default_chunk = False
        colour = "#ff8a80" if error else theme.MUTED
        self.status.setStyleSheet(f"color: {colour}; font-size: 8pt;")
        self.status.setText(text)


class LoadPanel(QGroupBox):
    start = Signal(object)  # LoadConfig
    stop = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("Load generator", parent)
        self.concurrency = QSpinBox(minimum=1, maximum=256, value=8)
        self.concurrency.setToolTip("concurrent synthetic chats")
        self.system_tokens = QSpinBox(minimum=0, maximum=4096, value=256, singleStep=32)
        self.system_tokens.setToolTip("length of the shared system prompt, in words (≈ tokens)")
        self.min_out = QSpinBox(minimum=1, maximum=4096, value=16)
        self.max_out = QSpinBox(minimum=1, maximum=4096, value=96)
        self.button = QPushButton("Start load")
        self.button.setCheckable(True)
        self.button.toggled.connect(self._toggled)
        self.stats = QLabel("idle")
        self.stats.setStyleSheet(f"color: {theme.MUTED}; font-size: 8pt;")
        self.stats.setWordWrap(True)
        grid = QGridLayout()
        grid.setVerticalSpacing(3)
        grid.addWidget(QLabel("chats"), 0, 0)
        grid.addWidget(self.concurrency, 0, 1)
        grid.addWidget(QLabel("system prompt"), 0, 2)
        grid.addWidget(self.system_tokens, 0, 3)
        grid.addWidget(QLabel("output min"), 1, 0)
        grid.addWidget(self.min_out, 1, 1)
        grid.addWidget(QLabel("max"), 1, 2)
        grid.addWidget(self.max_out, 1, 3)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(6, 12, 6, 6)
        lay.addLayout(grid)
        lay.addWidget(self.button)
        lay.addWidget(self.stats)
        self.setEnabled(False)

    def config(self) -> LoadConfig:
        lo, hi = self.min_out.value(), self.max_out.value()
        return LoadConfig(concurrency=self.concurrency.value(),
                          system_prompt_tokens=self.system_tokens.value(),
                          min_output_tokens=min(lo, hi), max_output_tokens=max(lo, hi))

    def boxes(self) -> dict[str, QSpinBox]:
        """The settings of the next load, by their QSettings key."""
        return {"concurrency": self.concurrency, "system_tokens": self.system_tokens,
                "min_out": self.min_out, "max_out": self.max_out}

    def _show_running(self, on: bool) -> None:
        self.button.setText("Stop load" if on else "Start load")
        for w in self.boxes().values():
            w.setEnabled(not on)

    def _toggled(self, on: bool) -> None:
        self._show_running(on)
        if on:
            self.start.emit(self.config())
        else:
            self.stop.emit()

    def set_running(self, on: bool) -> None:
        """Reflect the state without emitting (engine lost, or started from the command line)."""
        self.button.blockSignals(True)
        self.button.setChecked(on)
        self.button.blockSignals(False)
        self._show_running(on)

    def show_stats(self, s: dict) -> None:
        self.stats.setText(
            f"in flight {s.get('in_flight', 0)} · done {s.get('finished', 0)} · errors "
            f"{s.get('errors', 0)} · generated {s.get('generated_tokens', 0):,} tok · prompt "
            f"{s.get('prompt_tokens', 0):,} (cached {s.get('cached_tokens', 0):,})")
