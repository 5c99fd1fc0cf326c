"""GUI event-loop latency: how long an event posted to the GUI thread waits before it runs.

A helper thread emits a timestamped signal every `period_ms`; the queued slot in the GUI thread
records now - then. That is the delay a click or key press would see, whatever keeps the loop busy
(telemetry decoding, redraws, chat updates).
"""

from __future__ import annotations

import threading
import time

import numpy as np
from PySide6.QtCore import QObject, Signal


class LatencyProbe(QObject):
    ping = Signal(float)

    def __init__(self, period_ms: float = 10.0) -> None:
        super().__init__()  # lives in (and its slot runs on) the GUI thread
        self.period = period_ms / 1000.0
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.ping.connect(self._pong)

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="latency-probe", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(1.0)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.ping.emit(time.perf_counter())

    def _pong(self, sent: float) -> None:
        self.samples.append((time.perf_counter() - sent) * 1000.0)

    def result(self) -> dict[str, float]:
        a = np.asarray(self.samples) if self.samples else np.zeros(1)
        return {"n": len(self.samples), "p50": float(np.percentile(a, 50)),
                "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99)),
                "max": float(a.max())}
