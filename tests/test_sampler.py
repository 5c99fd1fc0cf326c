"""Sampler filters against a brute-force construction of the allowed set, and its draws
against the target distribution."""

import pytest
import torch

from engine_proc.sampler import sample
from engine_proc.sampling_params import SamplingParams


def allowed_brute_force(logits: torch.Tensor, p: SamplingParams) -> set[int]:
    probs = (logits.double() / p.temperature).softmax(-1)
    order = sorted(range(len(probs)), key=lambda i: -float(probs[i]))
    if p.top_k:
        order = order[: p.top_k]
    total = sum(float(probs[i]) for i in order) if p.top_k else 1.0
    kept, mass = [], 0.0
    for i in order:
        if mass >= p.top_p - 1e-12:
            break
        kept.append(i)
        mass += float(probs[i]) / total
    return set(kept)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=0.7, top_p=0.5),
        SamplingParams(temperature=1.3, top_k=40, top_p=0.8),
        SamplingParams(temperature=5.0, top_p=0.9),  # flat: nucleus beyond the fast candidates
    ],
)
def test_draws_stay_in_the_allowed_set(params):
    logits = torch.randn(2000, generator=torch.Generator().manual_seed(0)) * 3
    allowed = allowed_brute_force(logits, params)
    draws = {sample(logits[None], [params], [1], [t])[0] for t in range(300)}
    assert draws <= allowed
    if 1 < len(allowed) <= 20:
        assert len(draws) > 1


def test_frequencies_follow_the_distribution():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    params = SamplingParams(temperature=1.0)
    counts = torch.zeros(4)
    for t in range(4000):
        counts[sample(logits[None], [params], [3], [t])[0]] += 1
    torch.testing.assert_close(counts / 4000, logits.softmax(-1), atol=0.03, rtol=0)


def test_greedy_is_argmax_and_rows_are_independent():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=0),
    ]
    out = sample(logits, params, [0, 1, 2], [5, 5, 5])
    assert out[0] == int(logits[0].argmax()) and out[2] == int(logits[2].argmax())
    alone = sample(logits[1:2], params[1:2], [1], [5])
    assert alone[0] == out[1]
