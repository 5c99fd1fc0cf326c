"""Which experts the traffic wakes (routed-experts models: Qwen3-MoE, Mixtral): tokens routed to
each expert of each layer over the last seconds, as a heat map, layers down, experts across.

The engine publishes cumulative counts (`Telemetry.expert_counts`, [layer][expert]); the view
keeps the samples of the last `WINDOW_S` seconds and draws the newest minus the oldest. Items
are created once; `redraw` only sets the image and the caption."""

from __future__ import annotations

from collections import deque

import numpy as np
import pyqtgraph as pg
from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

from ui import theme
from ui.telemetry import Frame

WINDOW_S = 10.0


class ExpertRoutingView(QWidget):
    def __init__(self, window_s: float = WINDOW_S) -> None:
        super().__init__()
        self.window_s = window_s
        self._samples: deque[tuple[float, np.ndarray]] = deque()
        self._drawn: np.ndarray | None = None
        self.caption = QLabel("no routed experts in this model")
        self.caption.setStyleSheet(f"color: {theme.MUTED};")
        self.caption.setToolTip(
            "tokens the router sent to each expert of each layer in the last "
            f"{window_s:.0f} s (each token goes to top-k experts); dense layers stay empty")
        self.graphics = pg.GraphicsLayoutWidget()
        self.graphics.setBackground(theme.BG)
        self.plot = self.graphics.addPlot()
        self.plot.setLabel("bottom", "expert")
        self.plot.setLabel("left", "layer")
        self.plot.invertY(True)  # layer 0 at the top, as the model runs
        self.plot.setMouseEnabled(x=False, y=False)
        self.plot.hideButtons()
        self.image = pg.ImageItem(axisOrder="row-major")  # image[layer, expert]
        self.image.setLookupTable(pg.colormap.get("viridis").getLookupTable(nPts=256))
        self.plot.addItem(self.image)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.caption)
        layout.addWidget(self.graphics, 1)

    @property
    def has_experts(self) -> bool:
        return bool(self._samples)

    def add(self, frame: Frame) -> None:
        """A telemetry frame: its counts join the window (an engine without experts, or one that
        restarted, starts the window over)."""
        counts = frame.expert_counts
        if counts is None:
            self._samples.clear()
            return
        if self._samples:
            t_last, last = self._samples[-1]
            if frame.time < t_last or last.shape != counts.shape or (counts < last).any():
                self._samples.clear()
        self._samples.append((frame.time, counts))
        # keep one sample at or before the window's start: the baseline of the difference
        while len(self._samples) > 1 and self._samples[1][0] <= frame.time - self.window_s:
            self._samples.popleft()

    def window_counts(self) -> np.ndarray | None:
        """Tokens routed per [layer, expert] within the window (zeros until a second sample)."""
        if not self._samples:
            return None
        return self._samples[-1][1] - self._samples[0][1]

    def redraw(self) -> None:
        counts = self.window_counts()
        if counts is None:
            if self._drawn is not None:
                self.image.clear()
                self._drawn = None
                self.caption.setText("no routed experts in this model")
            return
        if self._drawn is not None and np.array_equal(counts, self._drawn):
            return
        self._drawn = counts
        self.image.setImage(counts.astype(np.float32), levels=(0, max(1, int(counts.max()))))
        # cell (layer, expert) centred on its index, so the axis ticks name the cells
        self.image.setRect(-0.5, -0.5, counts.shape[1], counts.shape[0])
        self.caption.setText(routing_caption(counts, self.window_s))


def routing_caption(counts: np.ndarray, window_s: float) -> str:
    """'tokens routed in the last 10 s: 1,204 (8 layers × 16 experts) · busiest: layer 3,
    expert 5, 18 % of that layer's'."""
    layers, experts = counts.shape
    total = int(counts.sum())
    text = (f"tokens routed in the last {window_s:.0f} s: {total:,} "
            f"({layers} layers × {experts} experts)")  # fmt: skip
    if total:
        layer, expert = np.unravel_index(int(np.argmax(counts)), counts.shape)
        share = counts[layer, expert] / max(1, counts[layer].sum())
        text += f" · busiest: layer {layer}, expert {expert}, {share:.0%} of that layer's"
    return text
