"""Speculative decoding's acceptance, from the engine's cumulative counters (vLLM's names,
engine_proc/spec_decode/verify.py): accepted / drafted per telemetry interval (the counters'
deltas between consecutive frames) and the accepted drafts by their position in the draft.

No Qt here: `ui.telemetry.History` feeds every frame in, the charts (ui/charts/spec.py) read it."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np


class Frame(Protocol):
    """What a history reads of a ui.telemetry.Frame (that module holds a SpecHistory)."""

    counters: dict[str, float]


DRAFTS = "spec_decode_num_drafts"
DRAFT_TOKENS = "spec_decode_num_draft_tokens"
ACCEPTED = "spec_decode_num_accepted_tokens"
PER_POS = "spec_decode_num_accepted_tokens_per_pos"


@dataclass(slots=True)
class SpecHistory:
    capacity: int = 4096
    # the latest frame's engine speculates (it sends the counters only then)
    enabled: bool = False
    num_drafts: float = 0.0  # speculative steps, cumulative
    draft_tokens: float = 0.0
    accepted_tokens: float = 0.0
    per_pos: np.ndarray = field(default_factory=lambda: np.zeros(0))  # accepted by position
    # (t, accepted / drafted, drafted, accepted) per interval that verified drafts; intervals
    # without any have no rate and no point
    points: deque[tuple[float, float, float, float]] = field(default_factory=deque)
    n: int = 0  # points ever appended (the charts redraw when it moves)
    _last: tuple[float, float] | None = None  # (draft tokens, accepted) at the previous frame

    def __post_init__(self) -> None:
        self.points = deque(maxlen=self.capacity)

    def add(self, f: Frame, t: float) -> None:
        """A frame at t seconds on the history's clock."""
        c = f.counters
        if DRAFT_TOKENS not in c:
            self.enabled, self._last = False, None
            return
        self.enabled = True
        drafted, accepted = c[DRAFT_TOKENS], c.get(ACCEPTED, 0.0)
        if self._last is not None:
            # dropped frames only widen an interval: the counters are cumulative
            dd, da = drafted - self._last[0], accepted - self._last[1]
            if dd > 0:
                self.points.append((t, da / dd, dd, da))
                self.n += 1
        self._last = (drafted, accepted)
        self.num_drafts = c.get(DRAFTS, 0.0)
        self.draft_tokens, self.accepted_tokens = drafted, accepted
        by_pos = {int(k.rpartition(":")[2]): v for k, v in c.items() if k.startswith(PER_POS + ":")}
        self.per_pos = np.array([by_pos.get(i, 0.0) for i in range(max(by_pos, default=-1) + 1)])

    def series(self) -> np.ndarray:
        """[n, 4] float: t, rate, drafted, accepted per interval, oldest first."""
        return np.array(self.points, dtype=np.float64).reshape(-1, 4)

    @property
    def total_rate(self) -> float:
        """Accepted / drafted since the engine started; NaN before its first draft."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else math.nan

    def rate_since(self, t0: float) -> float:
        """Accepted / drafted over the intervals from t0 on (a window's rate, not a mean of
        the intervals' rates: a busy interval weighs more)."""
        s = self.series()
        s = s[s[:, 0] >= t0]
        drafted = float(s[:, 2].sum())
        return float(s[:, 3].sum()) / drafted if drafted else math.nan
