"""N-gram speculative decoding in the engine: the same tokens as the engine without it (greedy,
and seeded sampling, whose draws are the same uniforms), through continuous batching, opt-outs,
prefix caching, chunked prefill and preemption, with no block leaked and no draft token ever in
the prefix cache's hash chain.

A tiny random model never repeats its prompt on its own: logit_bias on three tokens restricts it
to a three-token alphabet, over which its context still decides the order, so the n-gram drafts
are sometimes right and sometimes wrong (the tests assert both from the counters)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import pytest

from engine_proc import EngineConfig, LLMEngine, SamplingParams
from engine_proc.core.kv_cache_manager import block_hash, group_key, root_hash
from tests.tiny_models import tiny_model_dir

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1, "disable_by_batch_size": 0}  # fmt: skip (0: any batch drafts)
ALPHABET = {500: 100.0, 501: 100.0, 502: 100.0}
RUN_OF_FOUR = [7, 8, 9, 10] * 5 + [7, 8]
PROMPTS = [
    [500, 501, 502, 500, 500] * 4,
    list(range(300, 330)) + [500, 501, 502, 501] * 3,
    [7, 8, 9] * 6,
]


@pytest.fixture(scope="module")
def tiny_path():
    return tiny_model_dir(
        "llama", num_heads=4, num_kv_heads=2, num_layers=2, max_position_embeddings=1024
    )


def make(path, speculative: bool, **config) -> LLMEngine:
    config.setdefault("num_kv_blocks", 256)
    config.setdefault("block_size", 4)  # many block boundaries for drafts to cross
    spec = SPEC if speculative else None
    return LLMEngine(EngineConfig(model=str(path), speculative_config=spec, **config))


@pytest.fixture(scope="module")
def engines(tiny_path):
    return make(tiny_path, False), make(tiny_path, True)


def params_list(**kw) -> list[SamplingParams]:
    """A request per prompt: two constrained to the alphabet, one free (drafts mostly wrong),
    and the last alphabet request again with the per-request opt-out."""
    kw = {"max_tokens": 37, "ignore_eos": True} | kw
    return [
        SamplingParams(logit_bias=ALPHABET, **kw),
        SamplingParams(logit_bias=ALPHABET, **kw),
        SamplingParams(**kw),
        SamplingParams(logit_bias=ALPHABET, speculative=False, **kw),
    ]


@dataclass
class Streamed:
    request_id: str
    token_ids: list[int] = field(default_factory=list)  # from the deltas, as a client sees
    text: str = ""
    finish_reason: str | None = None
    logprobs: list = field(default_factory=list)


_ids = itertools.count()


def run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]):
    """Stream the requests together; their outputs (one per sequence) in request order."""
    free = engine.kv.pool.num_free
    outs: dict[tuple[str, int], Streamed] = {}
    for prompt, p in zip(prompts, params, strict=True):
        rid = f"r{next(_ids)}"
        engine.add_request(rid, prompt, p)
        for index in range(p.n):
            outs[(rid, index)] = Streamed(rid)
    while engine.has_unfinished_requests():
        for out in engine.step():
            s = outs[(out.request_id, out.index)]
            s.token_ids += out.new_token_ids
            s.text += out.text_delta
            s.logprobs += out.new_logprobs or []
            s.finish_reason = out.finish_reason
            assert out.token_ids == s.token_ids
    assert engine.kv.pool.num_free == free == engine.num_blocks, "blocks leaked"
    assert not engine.scheduler.running and not engine.scheduler.waiting
    result = list(outs.values())
    assert_hashes_are_of_real_tokens(engine, prompts, result)
    return result


_REAL: dict[int, set[bytes]] = {}  # per engine: the block hashes of every request it served


def assert_hashes_are_of_real_tokens(engine: LLMEngine, prompts, outs) -> None:
    """Every block in the prefix cache is a block of some request's prompt + output: no
    rejected draft ever entered the hash chain."""
    real = _REAL.setdefault(id(engine), set())
    bs = engine.block_size
    first = root_hash(engine.cache_identity, None)
    by_request = {}
    for out in outs:
        by_request.setdefault(out.request_id, []).append(out)
    for prompt, family in zip(prompts, by_request.values(), strict=True):
        for out in family:
            tokens = list(prompt) + list(out.token_ids)
            parent = first
            for i in range(len(tokens) // bs):
                parent = block_hash(parent, tokens[i * bs : (i + 1) * bs])
                real.add(parent)
                # a hybrid cache's sliding groups index their blocks under keys of the chain's
                real.update(group_key(parent, g) for g in range(1, len(engine.kv.windows)))
    cached = set(engine.kv.pool.hash_to_block)
    assert cached <= real, f"{len(cached - real)} cached blocks hold tokens no request has"


def spec_counts(engine: LLMEngine) -> tuple[int, int]:
    s = engine.stats.spec_decode
    return s.num_draft_tokens, s.num_accepted_tokens


@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": 0},
        {"temperature": 1.0, "seed": 11},
        {"temperature": 0.8, "top_k": 2, "seed": 5, "repetition_penalty": 1.3, "logprobs": 2},
        {"temperature": 1.0, "seed": 3, "presence_penalty": 0.5, "frequency_penalty": 0.3},
    ],
    ids=["greedy", "sampled", "topk-penalty-logprobs", "presence-frequency"],
)
def test_same_tokens_as_without_speculation(engines, kw) -> None:
    base, spec = engines
    prompts = PROMPTS + [PROMPTS[0]]
    drafted, accepted = spec_counts(spec)
    want = run(base, prompts, params_list(**kw))
    got = run(spec, prompts, params_list(**kw))
    for w, g in zip(want, got, strict=True):
        assert g.token_ids == w.token_ids
        assert g.text == w.text
        assert g.finish_reason == w.finish_reason
        if kw.get("logprobs") is not None:
            assert len(g.logprobs) == len(w.logprobs) == len(w.token_ids)
            for a, b in zip(g.logprobs, w.logprobs, strict=True):
                assert a.token_id == b.token_id
                assert a.logprob == pytest.approx(b.logprob, abs=1e-3)
                assert [t[0] for t in a.top] == [t[0] for t in b.top]
    drafted2, accepted2 = spec_counts(spec)
    assert accepted2 > accepted, "no draft was ever accepted"
    assert drafted2 - drafted > accepted2 - accepted, "no draft was ever rejected"
    c = spec.snapshot().counters
    assert c["spec_decode_num_accepted_tokens"] == accepted2
    assert sum(v for k, v in c.items() if k.startswith("spec_decode_num_accepted_tokens_per_pos:")
               ) == accepted2  # fmt: skip
    assert "spec_decode_num_drafts" not in base.snapshot().counters


def test_stops_inside_an_accepted_run(engines) -> None:
    """A stop token, a stop string and max_tokens that fall among accepted drafts: the tokens
    after them are dropped, as plain decoding never makes them."""
    base, spec = engines
    tok = base.tokenizer
    stop_text = tok.decode([502])
    cases = [
        SamplingParams(max_tokens=40, temperature=0, logit_bias=ALPHABET, stop_token_ids=[502]),
        SamplingParams(max_tokens=40, temperature=0, logit_bias=ALPHABET, stop=[stop_text]),
        SamplingParams(max_tokens=40, temperature=0, logit_bias=ALPHABET, ignore_eos=True),
    ]
    for max_tokens in (5, 6, 7, 9, 13):
        cases.append(SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                                    logit_bias=ALPHABET))  # fmt: skip
    prompts = [PROMPTS[0]] * len(cases)
    want = run(base, prompts, cases)
    got = run(spec, prompts, cases)
    for w, g in zip(want, got, strict=True):
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)


def test_parallel_sampling_forks(engines) -> None:
    base, spec = engines
    p = SamplingParams(n=3, max_tokens=30, temperature=1.0, seed=9, logit_bias=ALPHABET,
                       ignore_eos=True)  # fmt: skip
    want = run(base, [PROMPTS[1]], [p])
    got = run(spec, [PROMPTS[1]], [p])
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


# Small chunks, a small token budget and a pool of 40 blocks: prompts split beside decodes, a
# shared prefix, preemption.
PRESSURE = dict(num_kv_blocks=40, long_prefill_chunk=8, max_num_batched_tokens=24)


def pressure_requests() -> tuple[list[list[int]], list[SamplingParams]]:
    long_prompt = list(range(1000, 1060)) + [500, 501, 502] * 3
    prompts = [long_prompt, PROMPTS[0], long_prompt[:40] + [500, 502], PROMPTS[1]]
    params = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                             logit_bias=ALPHABET)] * 4  # fmt: skip
    return prompts, params


def test_chunked_prefill_prefix_caching_and_preemption(tiny_path) -> None:
    """A long prompt in small chunks beside decodes, a shared prefix hit, and a pool small
    enough to preempt: the same tokens, nothing leaked."""
    base = make(tiny_path, False, **PRESSURE)
    spec = make(tiny_path, True, **PRESSURE)
    prompts, params = pressure_requests()
    want = run(base, prompts, params)
    got = run(spec, prompts, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert spec.stats.num_preemptions > 0
    assert spec.stats.prefix_cache_hits > 0
    drafted, accepted = spec_counts(spec)
    assert 0 < accepted < drafted
    again = run(spec, prompts, params)  # now mostly prefix hits of blocks the drafts filled
    assert [g.token_ids for g in again] == [w.token_ids for w in want]


SCHEMA = {"type": "array", "minItems": 6, "maxItems": 8,
          "items": {"type": "object", "properties": {"colour": {"enum": ["red", "green"]}},
                    "required": ["colour"], "additionalProperties": False}}  # fmt: skip


@pytest.mark.parametrize("kw", [{"temperature": 0}, {"temperature": 1.0, "seed": 4}],
                         ids=["greedy", "sampled"])  # fmt: skip
def test_structured_output_speculates_with_each_row_masked(engines, kw) -> None:
    """A regex and a JSON schema whose outputs repeat themselves (so prompt lookup drafts):
    each verified row is masked by the grammar after the drafts before it, the matcher rolls
    back what the target rejects. The tokens are the plain engine's, drafts were accepted, and
    the JSON validates against the schema (jsonschema, not our grammar code)."""
    import json
    import re

    import jsonschema

    from ipc.messages import StructuredOutput

    base, spec = engines
    constraints = [StructuredOutput(kind="regex", spec="(ab)+", field="response_format"),
                   StructuredOutput(kind="json", spec=json.dumps(SCHEMA),
                                    field="response_format")]  # fmt: skip
    params = [SamplingParams(max_tokens=m, structured=c, **kw)
              for m, c in zip((40, 200), constraints, strict=True)]
    prompts = [PROMPTS[0], PROMPTS[2]]
    drafted, accepted = spec_counts(spec)
    want = run(base, prompts, params)
    got = run(spec, prompts, params)
    assert [(g.token_ids, g.text) for g in got] == [(w.token_ids, w.text) for w in want]
    assert spec_counts(spec)[1] > accepted and spec_counts(spec)[0] > drafted
    assert got[1].finish_reason == "stop", got[1].text  # the grammar completed
    jsonschema.validate(json.loads(got[1].text), SCHEMA)
    assert re.fullmatch("(ab)+a?", got[0].text)  # (a prefix of the regex's: max_tokens)


def assert_transformers_greedy(engine: LLMEngine, path, prompts: list[list[int]],
                               n: int = 24) -> None:
    """engine's greedy replies (ALPHABET's bias) are transformers' own generate() of the
    checkpoint at path: the independent reference."""
    from tests.tiny_models import hf_reference_model

    model = hf_reference_model(path)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True,
                             logit_bias=ALPHABET)] * len(prompts)  # fmt: skip
    for prompt, g in zip(prompts, run(engine, prompts, params), strict=True):
        assert g.token_ids == hf_alphabet_greedy(model, prompt, n)


def hf_alphabet_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy generate() of n tokens with ALPHABET's bias (its sequence_bias)."""
    import torch

    out = model.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=2,
        sequence_bias={(t,): b for t, b in ALPHABET.items()},
    )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def test_greedy_matches_transformers(engines, tiny_path) -> None:
    """Against an independent reference: transformers' greedy generate() of the same model,
    with the same bias on the alphabet (its sequence_bias)."""
    _, spec = engines
    drafted, accepted = spec_counts(spec)
    assert_transformers_greedy(spec, tiny_path, [PROMPTS[0], PROMPTS[1], RUN_OF_FOUR])
    drafted2, accepted2 = spec_counts(spec)
    assert accepted2 > accepted and drafted2 - drafted > accepted2 - accepted


def test_a_wide_batch_proposes_no_drafts(tiny_path):
    """vLLM's disable_by_batch_size: with more sequences running than it allows, no drafts;
    alone, the same request drafts. The tokens are the plain engine's either way."""
    spec = SPEC | {"disable_by_batch_size": 1}
    engine = LLMEngine(EngineConfig(model=str(tiny_path), speculative_config=spec,
                                    num_kv_blocks=256, block_size=4))
    plain = make(tiny_path, False)
    params = [SamplingParams(logit_bias=ALPHABET, max_tokens=24, ignore_eos=True)] * 2
    stats = engine.stats.spec_decode
    together = run(engine, PROMPTS[:2], params)
    assert stats.num_drafts == 0  # two running, one allowed: none proposed
    alone = run(engine, PROMPTS[:1], params[:1])
    assert stats.num_drafts > 0
    assert [o.token_ids for o in together] == [o.token_ids for o in run(plain, PROMPTS[:2],
                                                                          params)]
    assert alone[0].token_ids == run(plain, PROMPTS[:1], params[:1])[0].token_ids


def test_drafts_back_off_where_they_keep_failing(tiny_path):
    """Sampling over an eight-token alphabet: its tokens recur, so prompt lookup finds drafts
    almost every step, but the draws are mostly not what came before. After m speculative
    steps in a row that accepted nothing, a sequence skips its next min(2**(m - 1) - 1, 15)
    chances to draft, so it drafts in about half of its steps (nearly all without backing
    off); the tokens are the plain engine's. The schedule is recounted from each step's draft
    counter and the tokens the step added."""
    engine = make(tiny_path, True)
    alphabet = {600 + i: 100.0 for i in range(8)}
    params = SamplingParams(max_tokens=120, temperature=1.0, seed=3, ignore_eos=True,
                            logit_bias=alphabet)  # fmt: skip
    prompt = [600, 601, 602, 603] * 5
    engine.add_request("sampled", prompt, params)
    (seq,) = engine.requests["sampled"]
    seen: list[tuple[int, int]] = []  # per step: (drafts counter after it, tokens it added)
    while engine.has_unfinished_requests():
        before = seq.num_tokens
        engine.step()
        seen.append((engine.stats.spec_decode.num_drafts, seq.num_tokens - before))
    plain = run(make(tiny_path, False), [prompt], [params])
    assert [o.token_ids for o in plain] == [seq.output_token_ids]
    drafted = [i for i in range(len(seen)) if seen[i][0] > (seen[i - 1][0] if i else 0)]
    misses = 0
    for a, b in itertools.pairwise(drafted):
        misses = misses + 1 if seen[a][1] == 1 else 0  # one token: no draft accepted
        assert b - a - 1 >= min(2 ** (misses - 1) - 1, 15)
    assert 0 < len(drafted) < 0.6 * len(seen), (len(drafted), len(seen))
    assert max(b - a - 1 for a, b in itertools.pairwise(drafted)) >= 3  # it backed off
