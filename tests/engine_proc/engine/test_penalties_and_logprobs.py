"""logit_bias, penalties and logprobs end to end: the engine's greedy tokens against a loop that
recomputes transformers' forward pass of the whole text at every step and applies the formulas
one token at a time in float64, and its logprobs against log-softmax of transformers' logits."""

import heapq

import pytest
import torch

from engine_proc import EngineConfig, LLMEngine, SamplingParams
from tests.tiny_models import hf_reference_model, tiny_model_dir

MAX_TOKENS = 12
PROMPTS = [
    "The cat sat on the mat. The cat sat on the",
    "one two three one two three one two",
    "Paged attention keeps the KV cache in blocks.",
]


@pytest.fixture(scope="module")
def tiny_path():
    return tiny_model_dir(
        "llama", num_heads=4, num_kv_heads=2, num_layers=2, max_position_embeddings=1024
    )


@pytest.fixture(scope="module")
def engine(tiny_path):
    return LLMEngine(EngineConfig(model=str(tiny_path), num_kv_blocks=256))


@pytest.fixture(scope="module")
def hf_model(tiny_path):
    return hf_reference_model(tiny_path)


def processed(logits: list[float], p: SamplingParams, prompt: list[int], out: list[int]) -> list:
    """The documented formulas, one token at a time: bias, repetition (prompt and output),
    frequency and presence (output only)."""
    x = list(logits)
    for token, bias in p.logit_bias.items():
        x[token] += bias
    for token in set(prompt + out):
        x[token] = (
            x[token] / p.repetition_penalty if x[token] > 0 else x[token] * p.repetition_penalty
        )
    for token in set(out):
        count = out.count(token)
        x[token] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return x


@torch.no_grad()
def reference_greedy(model, prompt: list[int], p: SamplingParams) -> list[int]:
    out: list[int] = []
    for _ in range(p.max_tokens):
        logits = model(torch.tensor([prompt + out])).logits[0, -1].double().tolist()
        x = processed(logits, p, prompt, out)
        (first, best), (second, _) = heapq.nlargest(2, ((v, t) for t, v in enumerate(x)))
        assert first - second > 1e-3, "near-tie: float32 vs float64 could decide"
        out.append(best)
    return out


@torch.no_grad()
def reference_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), vocab] float64 log-softmax of the logits that predicted each output token."""
    logits = model(torch.tensor([prompt + output])).logits[0].double()
    return logits[len(prompt) - 1 : -1].log_softmax(-1)


def penalty_cases(prompt: list[int], plain: list[int]) -> list[tuple[dict, dict]]:
    """(sampling kwargs, the same without what is under test): each pair must differ. The
    random model seldom repeats itself, so a +10 bias on its first greedy token makes it."""
    bias = {plain[0]: 10.0}
    return [
        ({"repetition_penalty": 0.5}, {}),  # favours the prompt's tokens
        ({"logit_bias": bias, "repetition_penalty": 2.0}, {"logit_bias": bias}),
        ({"logit_bias": bias, "frequency_penalty": 1.0}, {"logit_bias": bias}),
        ({"logit_bias": bias, "presence_penalty": 2.0}, {"logit_bias": bias}),
        ({"logit_bias": bias, "frequency_penalty": -2.0}, {"logit_bias": bias}),
        ({"logit_bias": bias, "presence_penalty": -2.0}, {"logit_bias": bias}),
        # The plain greedy's first token banned, a prompt token pushed up (as JSON would send it).
        ({"logit_bias": {plain[0]: -100, str(prompt[-1]): 4.0}}, {}),
        (
            {
                "logit_bias": {**bias, plain[1]: -3.5},
                "repetition_penalty": 1.3,
                "frequency_penalty": 0.5,
                "presence_penalty": 0.5,
            },
            {"logit_bias": {**bias, plain[1]: -3.5}},
        ),
    ]


@pytest.mark.slow
def test_penalised_greedy_equals_a_recomputing_transformers_loop(engine, hf_model):
    common = dict(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    prompts, params, refs = [], [], []
    for text in PROMPTS:
        ids = engine.tokenize(text)
        memo: dict[str, list[int]] = {}

        def ref_of(kwargs: dict, ids: list[int] = ids, memo: dict = memo) -> list[int]:
            key = repr(sorted(kwargs.items()))
            if key not in memo:
                memo[key] = reference_greedy(hf_model, ids, SamplingParams(**kwargs, **common))
            return memo[key]

        plain = ref_of({})
        prompts.append(ids)
        params.append(SamplingParams(**common))
        refs.append(plain)
        for kwargs, without in penalty_cases(ids, plain):
            ref = ref_of(kwargs)
            assert ref != ref_of(without), f"{kwargs} should change the output of {text!r}"
            prompts.append(ids)
            params.append(SamplingParams(**kwargs, **common))
            refs.append(ref)
    # One batch: processed rows share every step with untouched ones.
    outputs = engine.generate(prompts, params)
    for ids, p, ref, out in zip(prompts, params, refs, outputs, strict=True):
        assert out.token_ids == ref, (engine.tokenizer.decode(ids), p)


def collect(engine: LLMEngine, request_id: str, prompt: list[int], p: SamplingParams) -> dict:
    """Run one request through step(); per sequence index: (token ids, streamed logprobs)."""
    engine.add_request(request_id, prompt, p)
    seqs: dict[int, tuple[list[int], list]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            ids, logprobs = seqs.setdefault(out.index, ([], []))
            assert out.new_logprobs is not None and len(out.new_logprobs) == len(out.new_token_ids)
            ids += out.new_token_ids
            logprobs += out.new_logprobs
            if out.finished:
                assert ids == out.token_ids
    return seqs


def check_logprobs(engine, hf_model, prompt, ids, logprobs, k) -> None:
    ref = reference_logprobs(hf_model, prompt, ids)
    assert len(logprobs) == len(ids) == ref.shape[0]
    for pos, (token, entry) in enumerate(zip(ids, logprobs, strict=True)):
        row = ref[pos]
        assert entry.token_id == token and entry.token == engine.tokenizer.decode([token])
        assert entry.logprob == pytest.approx(float(row[token]), abs=1e-4)
        assert len(entry.top) == k
        best = row.topk(k + 1)
        for j, (tid, text, lp) in enumerate(entry.top):
            assert text == engine.tokenizer.decode([tid])
            assert lp == pytest.approx(float(row[tid]), abs=1e-4)  # the id's own logprob
            assert lp == pytest.approx(float(best.values[j]), abs=1e-4)  # and the j-th best
        gaps = best.values[:-1] - best.values[1:]
        if k and bool((gaps > 1e-3).all()):  # ties aside, the same ids in the same order
            assert [t for t, _, _ in entry.top] == best.indices[:k].tolist()


@pytest.mark.parametrize("k", [0, 5, 20])
def test_greedy_logprobs_equal_transformers_log_softmax(engine, hf_model, k):
    prompt = engine.tokenize(PROMPTS[0])
    p = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=k)
    ((ids, logprobs),) = collect(engine, f"lp{k}", prompt, p).values()
    check_logprobs(engine, hf_model, prompt, ids, logprobs, k)
    if k:
        assert all(e.top[0][0] == e.token_id for e in logprobs)  # greedy takes the best


def test_logprobs_are_raw_under_penalties_and_per_sequence_when_sampling(engine, hf_model):
    prompt = engine.tokenize(PROMPTS[1])
    p = SamplingParams(
        max_tokens=6,
        temperature=0,
        ignore_eos=True,
        logprobs=3,
        logit_bias={1000: 15.0},
        presence_penalty=1.0,
        repetition_penalty=1.5,
    )
    ((ids, logprobs),) = collect(engine, "raw", prompt, p).values()
    check_logprobs(engine, hf_model, prompt, ids, logprobs, 3)
    assert 1000 in ids and all(e.top[0][0] != 1000 for e in logprobs), "raw, not biased"

    p = SamplingParams(max_tokens=6, temperature=1.0, seed=3, n=3, logprobs=2, ignore_eos=True)
    seqs = collect(engine, "forks", prompt, p)
    assert sorted(seqs) == [0, 1, 2] and len({tuple(ids) for ids, _ in seqs.values()}) > 1
    for ids, logprobs in seqs.values():
        check_logprobs(engine, hf_model, prompt, ids, logprobs, 2)


def test_no_logprobs_unless_asked(engine):
    (out,) = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0))
    assert out.new_logprobs is None
