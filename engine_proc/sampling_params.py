"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ipc.messages import StructuredOutput

MAX_LOGPROBS = 20  # most top candidates per token (OpenAI's top_logprobs limit)
MAX_LOGIT_BIAS = 100.0
MAX_PENALTY = 2.0  # presence / frequency, OpenAI's range
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
# The engine's bound on a constraint's text (the API refuses user grammars over 64 KiB; a
# tool_choice schema built from many tools may be larger).
MAX_STRUCTURED_SPEC = 256 * 1024


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
    # OpenAI: over this sequence's output so far, logit[t] -= presence * (count[t] > 0)
    # + frequency * count[t].
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # HF / vLLM: every token of prompt and output has its logit divided by this when positive,
    # multiplied when not (1 = off).
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    logprobs: int | None = None  # None = off; k: the chosen token's logprob and the top k
    structured: StructuredOutput | None = None  # the grammar the output follows
    # False: never speculate for this request, even when the engine has a speculative_config
    speculative: bool = True

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
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must be a number in [-2, 2] (0 = off), got {value!r}")
        penalty = self.repetition_penalty
        if not _is_number(penalty) or not 0 < penalty < math.inf:
            raise ValueError(
                f"repetition_penalty must be a finite number > 0 (1 = off), got {penalty!r}"
            )
        self.logit_bias = _checked_logit_bias(self.logit_bias)
        if self.logprobs is not None and not (
            _is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"logprobs must be None (off) or an integer in [0, {MAX_LOGPROBS}], "
                f"got {self.logprobs!r}"
            )
        if self.structured is not None:
            _check_structured(self.structured)
        if not isinstance(self.speculative, bool):
            raise ValueError(f"speculative must be true or false, got {self.speculative!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )

    @property
    def processes_logits(self) -> bool:
        """Whether the logits are changed (bias, penalties) before the token is chosen."""
        return bool(self.logit_bias) or self.has_penalties


def _check_structured(so: object) -> None:
    """Shape only: whether the constraint compiles is decided by engine_proc/structured."""
    if not isinstance(so, StructuredOutput):
        raise ValueError(f"structured must be a StructuredOutput or None, got {so!r}")
    if so.kind not in STRUCTURED_KINDS:
        raise ValueError(
            f"{so.field}: structured kind must be one of {', '.join(STRUCTURED_KINDS)}, "
            f"got {so.kind!r}"
        )
    if not isinstance(so.spec, str):
        raise ValueError(
            f"{so.field}: the constraint must be a string, got {type(so.spec).__name__}"
        )
    if len(so.spec) > MAX_STRUCTURED_SPEC:
        raise ValueError(
            f"{so.field}: grammar too large ({len(so.spec)} characters; at most "
            f"{MAX_STRUCTURED_SPEC})"
        )
    if so.kind != "json_object" and not so.spec.strip():
        raise ValueError(f"{so.field}: the {so.kind} constraint is empty")


def _checked_logit_bias(bias: object) -> dict[int, float]:
    """A copy with int keys: JSON (OpenAI) sends token ids as decimal strings."""
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {bias!r}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = key
        if isinstance(key, str) and key.isascii() and key.isdecimal():
            token = int(key)
        if not _is_int(token) or token < 0:
            raise ValueError(
                f"logit_bias keys must be token ids (integers >= 0, or their decimal strings), "
                f"got {key!r}"
            )
        if not _is_number(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise ValueError(
                f"logit_bias values must be numbers in [-100, 100], got {value!r} for {key!r}"
            )
        if token in out:
            raise ValueError(f"logit_bias has token id {token} twice (as {key!r})")
        out[token] = float(value)
    return out


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
