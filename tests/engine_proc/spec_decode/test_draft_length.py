"""The draft length: per sequence, 2 at first, 2 more after a step that confirmed every draft
(up to num_speculative_tokens), half after one that rejected some; the tokens stay the plain
engine's."""

from __future__ import annotations

import pytest

from engine_proc import EngineConfig, LLMEngine, SamplingParams
from engine_proc.spec_decode.draft_length import next_draft_length
from tests.tiny_models import tiny_model_dir


@pytest.mark.parametrize(
    ("length", "drafted", "accepted", "most", "expected"),
    [
        (2, 2, 2, 8, 4),  # all confirmed: 2 more
        (8, 8, 8, 8, 8),  # ... up to the most
        (7, 7, 7, 8, 8),
        (8, 8, 3, 8, 4),  # some rejected: half
        (8, 5, 0, 8, 4),  # (of the length, not of how many the proposer found)
        (1, 1, 0, 8, 1),  # never below one
        (6, 3, 3, 8, 8),  # fewer drafts than the length, all confirmed: grows
        (4, 0, 0, 8, 4),  # no drafts: unchanged
    ],
)
def test_next_draft_length(length, drafted, accepted, most, expected) -> None:
    assert next_draft_length(length, drafted, accepted, most) == expected


@pytest.fixture(scope="module")
def tiny_path():
    return tiny_model_dir("llama", num_heads=4, num_kv_heads=2, num_layers=2)


class Oracle:
    """Drafts the plain engine's next tokens, with a wrong one at position wrong[call] (if
    any) of the call-th proposal; records the k it was asked for."""

    def __init__(self, truth: list[int], prompt_len: int, wrong: dict[int, int]) -> None:
        self.num_speculative_tokens = 8
        self.truth, self.prompt_len, self.wrong, self.asked = truth, prompt_len, wrong, []

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        call = len(self.asked)
        self.asked.append(k)
        done = len(token_ids) - self.prompt_len
        drafts = self.truth[done : done + k]
        if call in self.wrong and self.wrong[call] < len(drafts):
            drafts[self.wrong[call]] = (drafts[self.wrong[call]] + 1) % 1000
        return drafts


def test_the_engine_grows_and_halves_each_sequences_draft_length(tiny_path) -> None:
    config = {"model": str(tiny_path), "num_kv_blocks": 128, "block_size": 4}
    prompt = list(range(40, 60))
    params = SamplingParams(max_tokens=90, temperature=0, ignore_eos=True)
    plain = LLMEngine(EngineConfig(**config)).generate([prompt], params)[0].token_ids
    spec = {"method": "ngram", "num_speculative_tokens": 8, "disable_by_batch_size": 0}
    engine = LLMEngine(EngineConfig(speculative_config=spec, **config))
    # proposals 0-4 all right, 5 wrong at its 4th draft, 6-8 right, 9 wrong at its 1st
    oracle = Oracle(plain, len(prompt), {5: 3, 9: 0})
    engine.proposer = oracle
    out = engine.generate([prompt], params)[0]
    assert out.token_ids == plain
    # 2, +2 a step to 8; 8 with three confirmed -> 4; +2 to 8; one with none confirmed -> 4
    assert oracle.asked[:11] == [2, 4, 6, 8, 8, 8, 4, 6, 8, 8, 4]
    stats = engine.stats.spec_decode
    assert stats.num_accepted_tokens == stats.num_draft_tokens - (8 - 3) - 8
