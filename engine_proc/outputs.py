"""What the engine hands back: per step, per request (and per sequence when n > 1)."""

from __future__ import annotations

from dataclasses import dataclass, field

FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float  # engine monotonic clock, seconds
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    token_times: list[float] = field(default_factory=list)  # one per output token

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def itl(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        t = self.token_times
        return None if len(t) < 2 else (t[-1] - t[0]) / (len(t) - 1)


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probabilities of one sampled token: log-softmax of the model's raw logits (before
    logit_bias, penalties and temperature), as vLLM reports them by default."""

    token_id: int
    token: str  # tokenizer.decode([token_id]) (may hold U+FFFD for part of a character)
    logprob: float
    top: list[tuple[int, str, float]]  # (token id, token, logprob) of the k best, best first


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    index: int  # sequence index within the request (0..n-1)
    new_token_ids: list[int]  # produced by this step
    text_delta: str  # text that became final in this step (never half a character)
    token_ids: list[int]  # all output tokens so far
    text: str  # all output text so far
    num_prompt_tokens: int
    num_cached_tokens: int
    finish_reason: str | None = None  # stop | length | abort | error
    error: str | None = None
    metrics: RequestMetrics | None = None
    new_logprobs: list[TokenLogprobs] | None = None  # one per new token, when params.logprobs
    kv_handoff: tuple[str, list[bytes]] | None = None  # prefill role: (lease id, block hashes)
    # speculative decoding, so far: drafts verified for this sequence and how many it confirmed
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
