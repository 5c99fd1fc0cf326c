"""Verification as rejection sampling, on synthetic logits: over many seeds, the first emitted
token is distributed as the target p (chi-square), a draft d is accepted with probability p(d),
a rejected position's token follows p with d removed and renormalised, and the token after an
accepted draft follows the next position's target. Compared with the distributions computed
here from the logits, not with the sampler's own output."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from engine_proc.executor.sampler import sample
from engine_proc.sampling_params import SamplingParams
from engine_proc.spec_decode.verify import SpecDecodeStats, num_accepted

VOCAB = 12
N = 6000


def target(logits: torch.Tensor, p: SamplingParams) -> np.ndarray:
    probs = torch.softmax(logits / p.temperature, dim=-1).double().numpy()
    if p.top_k:
        cut = np.sort(probs)[-p.top_k]
        probs = np.where(probs >= cut, probs, 0.0)
    return probs / probs.sum()


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was drawn"
    expected = probs[keep] * counts.sum()
    return float(stats.chisquare(counts[keep], expected).pvalue)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.7, top_k=5)])  # fmt: skip
def test_rejection_sampling_keeps_the_target_distribution(params: SamplingParams) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, VOCAB, generator=gen) * 1.5  # positions 0, 1, 2 (bonus)
    p = [target(row, params) for row in logits]
    d1 = int(np.argsort(p[0])[-2])  # a plausible but not the likeliest draft
    d2 = int(np.argmax(p[1]))
    drafts = [d1, d2]
    first = np.zeros(VOCAB)
    after_reject = np.zeros(VOCAB)
    second_given_accept = np.zeros(VOCAB)
    accepted_first = 0
    record = SpecDecodeStats()
    for seed in range(N):
        tokens = sample(logits, [params] * 3, [seed] * 3, [0, 1, 2])
        a = num_accepted(drafts, tokens)
        record.observe(2, a)
        emitted = tokens[: a + 1]
        first[emitted[0]] += 1
        if a == 0:
            after_reject[emitted[0]] += 1
        else:
            accepted_first += 1
            second_given_accept[emitted[1]] += 1
    assert chi_square_p(first, p[0]) > 1e-3
    rejected = p[0].copy()
    rejected[d1] = 0
    assert chi_square_p(after_reject, rejected / rejected.sum()) > 1e-3
    assert stats.binomtest(accepted_first, N, p[0][d1]).pvalue > 1e-3
    assert chi_square_p(second_given_accept, p[1]) > 1e-3
    assert record.num_drafts == N and record.num_draft_tokens == 2 * N
    assert record.num_accepted_tokens_per_pos[0] == accepted_first


def test_greedy_accepts_while_drafts_are_the_argmax() -> None:
    logits = torch.zeros(4, VOCAB)
    for row, best in enumerate([3, 5, 7, 1]):
        logits[row, best] = 5.0
    tokens = sample(logits, [SamplingParams(temperature=0)] * 4, [0] * 4, [0, 1, 2, 3])
    assert num_accepted([3, 5, 7], tokens) == 3  # and the bonus token is tokens[3]
    assert num_accepted([3, 4, 7], tokens) == 1  # then the target's 5
    assert num_accepted([2, 5, 7], tokens) == 0
