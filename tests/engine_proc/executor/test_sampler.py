"""Sampler filters against a brute-force construction of the allowed set, its draws against
the target distribution, logit_bias and penalties against a per-token loop, and logprobs against
a log-softmax written out by hand."""

import math

import pytest
import torch

from engine_proc.executor.sampler import argmax_rows, compute_logprobs, process_logits, sample
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


# ------------------------------------------------------------ logit_bias and penalties


def processed_brute_force(
    logits: list[float], p: SamplingParams, prompt: list[int], output: list[int]
) -> list[float]:
    """One token at a time, in float64: bias, repetition (prompt and output), then frequency and
    presence (output only)."""
    out = list(logits)
    for token, bias in p.logit_bias.items():
        out[token] += bias
    for token in set(prompt + output):
        if out[token] > 0:
            out[token] /= p.repetition_penalty
        else:
            out[token] *= p.repetition_penalty
    for token in set(output):
        count = output.count(token)
        out[token] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return out


PENALTY_CASES = [
    SamplingParams(temperature=0, repetition_penalty=1.7),
    SamplingParams(temperature=0, repetition_penalty=0.6),  # < 1 favours repeats
    SamplingParams(temperature=0.8, frequency_penalty=0.9),
    SamplingParams(temperature=0, presence_penalty=-1.5),
    SamplingParams(temperature=0, logit_bias={3: 7.5, "11": -100, 0: 0.25}),
    SamplingParams(
        temperature=1.0,
        repetition_penalty=1.3,
        frequency_penalty=0.4,
        presence_penalty=1.1,
        logit_bias={5: 2.0, 29: -3.0},
    ),
    SamplingParams(temperature=0),  # nothing to do: copied unchanged
]


def test_processed_logits_equal_a_per_token_loop():
    gen = torch.Generator().manual_seed(4)
    vocab = 30
    logits = torch.randn(len(PENALTY_CASES), vocab, generator=gen) * 3
    raw = logits.clone()
    rng = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, vocab, (8,), generator=rng).tolist() for _ in PENALTY_CASES]
    outputs = [torch.randint(0, vocab, (3 * i,), generator=rng).tolist() for i in range(7)]
    outputs = [o + o[:2] for o in outputs]  # tokens generated more than once
    outputs[-1] = []  # first token: nothing generated yet
    token_ids = [p + o for p, o in zip(prompts, outputs, strict=True)]
    got = process_logits(logits, PENALTY_CASES, token_ids, [len(p) for p in prompts])
    assert torch.equal(logits, raw), "the raw logits must stay as they are (logprobs read them)"
    for i, p in enumerate(PENALTY_CASES):
        ref = processed_brute_force(logits[i].double().tolist(), p, prompts[i], outputs[i])
        torch.testing.assert_close(
            got[i].double(), torch.tensor(ref, dtype=torch.float64), atol=1e-5, rtol=1e-6
        )


def test_batch_without_processing_is_passed_through():
    logits = torch.randn(3, 10)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.5, top_k=3)] * 2
    assert process_logits(logits, params[:3], None, None) is logits


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(temperature=0), 0),
        (SamplingParams(temperature=0, repetition_penalty=2.0), 1),  # 4.0 -> 2.0 < 3.0
        (SamplingParams(temperature=0, frequency_penalty=0.6), 1),  # 4.0 - 3 * 0.6 = 2.2
        (SamplingParams(temperature=0, presence_penalty=1.5), 1),  # 4.0 - 1.5 = 2.5
        (SamplingParams(temperature=0, presence_penalty=0.5), 0),  # 3.5 still ahead
        (SamplingParams(temperature=0, logit_bias={2: 4.0}), 2),
        (SamplingParams(temperature=0, logit_bias={0: -100}), 1),
        # Negative logits are multiplied: token 3 (-0.5 -> -1.0) drops below token 4 (-0.8).
        (
            SamplingParams(temperature=0, repetition_penalty=2.0, logit_bias={0: -9, 1: -9, 2: -9}),
            4,
        ),
    ],
)
def test_greedy_choice_changes_because_of_the_penalty(params, expected):
    logits = torch.tensor([[4.0, 3.0, 0.5, -0.5, -0.8, -2.0]])
    prompt, output = [3, 5], [0, 0, 0]  # token 0 was generated three times; token 3 is prompt
    got = sample(logits, [params], [0], [3], [prompt + output], [len(prompt)])
    assert got == [expected]


def test_biased_rows_keep_their_seeded_draws_whatever_shares_the_batch():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(6))
    biased = SamplingParams(temperature=1.0, logit_bias={7: 3.0}, frequency_penalty=1.0)
    others = [SamplingParams(temperature=0.7), SamplingParams(temperature=0, presence_penalty=2)]
    ids = [[9, 1], [1, 2, 7, 7], [4, 4]]
    for t in range(20):
        alone = sample(logits[1:2], [biased], [11], [t], ids[1:2], [2])
        crowd = sample(logits, [others[0], biased, others[1]], [3, 11, 5], [t] * 3, ids, [1, 2, 1])
        assert crowd[1] == alone[0]
    draws = {
        sample(logits[:1], [SamplingParams(logit_bias={7: 100})], [1], [t])[0] for t in range(20)
    }
    assert draws == {7}


# ------------------------------------------------------------ logprobs


def test_logprobs_are_the_raw_log_softmax_with_the_top_k():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(8)) * 2
    ks = [3, None, 0, 20]
    tokens = [5, 6, 7, int(logits[3].argmax())]
    got = compute_logprobs(logits, ks, tokens)
    assert got[1] is None
    for i, k in enumerate(ks):
        if k is None:
            continue
        row = logits[i].double().tolist()
        log_z = math.log(sum(math.exp(x) for x in row))
        ref = [x - log_z for x in row]
        chosen, top = got[i]
        assert chosen == pytest.approx(ref[tokens[i]], abs=1e-5)
        best = sorted(range(50), key=lambda t: -ref[t])[:k]
        assert [t for t, _ in top] == best
        assert [lp for _, lp in top] == pytest.approx([ref[t] for t in best], abs=1e-5)


def test_argmax_rows_is_torchs_argmax_with_ties_and_nans():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(3))
    logits[1, 40] = logits[1, 200] = float("nan")  # the first NaN wins, as in torch
    logits[2] = 0.5  # all tied: the first index
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1  # tied maxima
    for view in (logits, logits[:, ::3], logits.bfloat16()):
        assert argmax_rows(view) == view.argmax(dim=-1).tolist()
    assert argmax_rows(logits) == [int(logits[0].argmax()), 40, 0, 10]


def test_entries_of_probability_zero_are_never_drawn():
    logits = torch.tensor([[1.0, 0.0, float("-inf"), 2.0, float("-inf")]])
    params = SamplingParams(temperature=1.0)
    draws = [sample(logits, [params], [5], [t])[0] for t in range(3000)]
    assert set(draws) == {0, 1, 3}
    freq = torch.bincount(torch.tensor(draws), minlength=5).float() / len(draws)
    torch.testing.assert_close(freq, logits[0].softmax(-1), atol=0.03, rtol=0)


def test_the_uniform_draws_are_uniform_and_a_function_of_seed_and_position():
    from engine_proc.executor.sampler import _uniform

    draws = torch.tensor([_uniform(seed, t) for seed in range(4) for t in range(2500)])
    assert 0.0 <= float(draws.min()) and float(draws.max()) < 1.0
    # Kolmogorov-Smirnov against U(0, 1): 1.63 / sqrt(n) is the 1% critical value
    ks = (torch.sort(draws).values - torch.arange(1, 10001) / 10000).abs().max()
    assert float(ks) < 1.63 / 100
    assert len({_uniform(7, 3), _uniform(7, 4), _uniform(8, 3), _uniform(3, 7)}) == 4


@pytest.mark.parametrize("params", [SamplingParams(top_k=3), SamplingParams(top_p=0.99)])
def test_filtered_draws_do_not_depend_on_the_candidates_rank_order(params):
    """Two near-equal candidates swapping ranks (a recomputed prefill's last bits) must not
    swap which token a given uniform draws: only draws near the moved boundary may change."""
    logits = torch.tensor([[0.5, 1.0, 1.0 + 2e-7, 0.0, -9.0]])
    swapped = logits.clone()
    swapped[0, 1], swapped[0, 2] = logits[0, 2], logits[0, 1]
    same = sum(
        sample(logits, [params], [9], [t]) == sample(swapped, [params], [9], [t])
        for t in range(400)
    )
    assert same >= 398
