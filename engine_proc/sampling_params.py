"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_int("n", self.n, low=1)
        _check_int("top_k", self.top_k, low=0, note=" (0 = off)")
        if self.seed is not None:
            _check_int("seed", self.seed, low=0, high=2**63)
        if not _is_number(self.temperature) or not self.temperature >= 0:
            raise ValueError(
                f"temperature must be a number >= 0 (0 = greedy), got {self.temperature!r}"
            )
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_int(name: str, value: object, low: int, high: int | None = None, note: str = "") -> None:
    ok = _is_int(value) and low <= value and (high is None or value < high)
    if not ok:
        top = "2**63" if high == 2**63 else str(high)
        allowed = f">= {low}{note}" if high is None else f"an integer in [{low}, {top})"
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
