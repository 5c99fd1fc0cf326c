"""KV transfer between the two engines of a disaggregated deployment, from their telemetry
counters (docs/PROTOCOL.md section 10; no Qt): blocks and MB pulled per second, the mean time of
one request's pull, pulls pending and failed (decode engine), leases held and expired (prefill
engine).

Rates are over the last `window_s` seconds of the decode engine's own clock, like
ui/telemetry.History's: the oldest snapshot kept is the last one at least `window_s` before the
newest, so regular snapshots span exactly the window. Each engine's counters are only ever
compared with its own earlier ones (two engines need not share a clock).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from ui.telemetry import Frame, Ring

MB = 1e6  # transfer rates in MB/s (10^6 bytes), as network and disk rates are given
# decode-side counters kept per snapshot, in this order
PULL_COUNTERS = ("kv_transfer_pulls", "kv_transfer_pull_seconds", "kv_transfer_bytes_received",
                 "kv_transfer_blocks_received", "kv_transfer_pull_failures")


@dataclass(slots=True)
class TransferRates:
    window_s: float = 10.0
    blocks_per_s: float = math.nan  # blocks pulled per second over the window
    mb_per_s: float = math.nan  # MB pulled per second over the window
    pull_ms: float = math.nan  # mean time of one request's pull over the window (none: NaN)
    pull_ms_total: float = math.nan  # the same since the decode engine started
    pulls: float = 0.0  # since start
    pulls_window: float = 0.0
    failures: float = 0.0  # pulls that failed (recomputed or the request failed), since start
    failures_window: float = 0.0
    pending: float = 0.0  # pulls in flight now
    already_cached: float = 0.0  # prompt blocks the decode pool had: never pulled
    releases: float = 0.0  # leases ended without pulling anything
    leases_active: float = math.nan  # prefill engine, now (NaN: no prefill telemetry yet)
    leases_expired: float = math.nan  # prefill engine, since start
    leases_granted: float = math.nan


class TransferHistory:
    """Transfer rates at the latest decode snapshot, and one row per decode snapshot for the
    charts (time since the decode engine's first snapshot, as ui/telemetry.History's)."""

    T, BLOCKS_PS, MB_PS, PULL_MS, PENDING = range(5)

    def __init__(self, window_s: float = 10.0, capacity: int = 4096) -> None:
        self.window_s = window_s
        self.rows = Ring(capacity, 5)
        self.t0: float | None = None
        self.last_time: float | None = None
        self.rates = TransferRates(window_s=window_s)
        self._hist: deque[tuple[float, ...]] = deque()  # (time, *PULL_COUNTERS)
        self._prefill: dict[str, float] = {}  # the latest counters of each engine
        self._decode: dict[str, float] = {}

    def clear_decode(self) -> None:
        self.rows.clear()
        self.t0 = self.last_time = None
        self._hist.clear()
        self._decode = {}
        self.rates = self._rates()

    def clear_prefill(self) -> None:
        self._prefill = {}
        self.rates = self._rates()

    def add_prefill(self, f: Frame) -> None:
        self._prefill = f.counters
        self.rates = self._rates()

    def add_decode(self, f: Frame) -> None:
        if self.t0 is None or (self.last_time is not None and f.time < self.last_time):
            self.clear_decode()  # first snapshot, or a restarted engine on a new clock
            self.t0 = f.time
        self.last_time = f.time
        self._decode = c = f.counters
        self._hist.append((f.time, *(c.get(name, 0.0) for name in PULL_COUNTERS)))
        h = self._hist
        while len(h) > 2 and f.time - h[1][0] >= self.window_s:
            h.popleft()
        self.rates = r = self._rates()
        self.rows.append((f.time - self.t0, r.blocks_per_s, r.mb_per_s, r.pull_ms, r.pending))

    def _rates(self) -> TransferRates:
        r = TransferRates(window_s=self.window_s)
        p, d = self._prefill, self._decode
        if p:
            r.leases_active = p.get("kv_transfer_leases_active", 0.0)
            r.leases_expired = p.get("kv_transfer_leases_expired", 0.0)
            r.leases_granted = p.get("kv_transfer_leases_granted", 0.0)
        if not d:
            return r
        r.pulls = d.get("kv_transfer_pulls", 0.0)
        seconds = d.get("kv_transfer_pull_seconds", 0.0)
        r.pull_ms_total = seconds / r.pulls * 1e3 if r.pulls > 0 else math.nan
        r.failures = d.get("kv_transfer_pull_failures", 0.0)
        r.pending = d.get("kv_transfer_pulls_pending", 0.0)
        r.already_cached = d.get("kv_transfer_blocks_already_cached", 0.0)
        r.releases = d.get("kv_transfer_releases", 0.0)
        if len(self._hist) >= 2:
            (t0, n0, s0, b0, k0, f0), (t1, n1, s1, b1, k1, f1) = self._hist[0], self._hist[-1]
            dt = max(t1 - t0, 1e-6)
            r.blocks_per_s, r.mb_per_s = (k1 - k0) / dt, (b1 - b0) / MB / dt
            r.pulls_window, r.failures_window = n1 - n0, f1 - f0
            r.pull_ms = (s1 - s0) / (n1 - n0) * 1e3 if n1 > n0 else math.nan
        return r
