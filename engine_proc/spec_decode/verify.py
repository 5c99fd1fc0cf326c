"""Verification of drafts: which of them the target model confirms, and its token after them.

The sampler (engine_proc/executor/sampler.py) draws output position t of a sequence by inverse
CDF from one uniform u(seed, t). A speculative row samples its 1 + k positions that way, each
from the target's distribution given the drafts before it, and the drafts are accepted while
they equal those tokens; the first token that differs (or the bonus token after k accepted
drafts) ends the step. For a point-mass draft distribution q = [d] (an n-gram proposer), this
is Leviathan et al.'s rejection sampling (vLLM's rejection_sampler.py) exactly: d is accepted
with probability p(d) (u falls in d's interval), and on rejection the token is p's draw given
u outside d's interval, i.e. p with d removed and renormalised, which is norm(max(p - q, 0)).
Greedy rows are the argmax case. Because the uniforms are the ones plain decoding draws, a
seeded request gets the very tokens it gets without speculation."""

from __future__ import annotations

from dataclasses import dataclass, field

PER_POS_KEY = "spec_decode_num_accepted_tokens_per_pos"


def num_accepted(drafts: list[int], sampled: list[int]) -> int:
    """How many leading drafts the target's tokens at the same positions confirm."""
    assert len(sampled) == len(drafts) + 1, (len(drafts), len(sampled))
    a = 0
    while a < len(drafts) and drafts[a] == sampled[a]:
        a += 1
    return a


@dataclass(slots=True)
class SpecDecodeStats:
    """vLLM's spec_decode counters (vllm/v1/spec_decode/metrics.py): speculative steps of a
    sequence, drafts proposed, drafts accepted, and accepted drafts by their position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += accepted
        per_pos = self.num_accepted_tokens_per_pos
        per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for i in range(accepted):
            per_pos[i] += 1

    def counters(self) -> dict[str, float]:
        """For the telemetry snapshot: the per-position counts as `..._per_pos:<i>` keys."""
        out: dict[str, float] = {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
        }
        for i, n in enumerate(self.num_accepted_tokens_per_pos):
            out[f"{PER_POS_KEY}:{i}"] = n
        return out
