"""The charts' memory of a server watched through /metrics: one row per `MetricSample` (no Qt).

None (not reported, or nothing to say yet) becomes NaN, which the charts leave as a gap rather
than drawing as zero.
"""

from __future__ import annotations

import math

import numpy as np

from app.remote.samples import QUANTILES, MetricSample
from ui.telemetry import Ring


def _f(v: float | None) -> float:
    return math.nan if v is None else float(v)


class MetricsHistory:
    # columns
    T, RUNNING, WAITING, KV, HIT, PTPS, GTPS, PREEMPT, TTFT50, TTFT90, TTFT99, ITL50, ITL90, \
        ITL99 = range(14)

    def __init__(self, capacity: int = 2048) -> None:
        self.rows = Ring(capacity, 14)
        self.t0: float | None = None
        self.latest: MetricSample | None = None

    def clear(self) -> None:
        self.rows.clear()
        self.t0 = None
        self.latest = None

    def add(self, s: MetricSample) -> None:
        if self.t0 is None or (self.latest is not None and s.time < self.latest.time):
            self.clear()
            self.t0 = s.time
        self.latest = s
        ttft = s.ttft or {}
        itl = s.itl or {}
        self.rows.append((
            s.time - self.t0, _f(s.running), _f(s.waiting), _f(s.kv_usage), _f(s.hit_rate),
            _f(s.prompt_tps), _f(s.gen_tps), _f(s.preemptions_per_s),
            *(_f(ttft.get(q)) for q in QUANTILES), *(_f(itl.get(q)) for q in QUANTILES),
        ))  # fmt: skip

    def view(self) -> np.ndarray:
        return self.rows.view()

    @property
    def n(self) -> int:
        return self.rows.n
