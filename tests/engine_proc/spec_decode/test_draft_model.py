"""Draft-model speculative decoding: a second model proposes, the target verifies. The tokens
are the plain engine's whatever the draft model is (greedy and seeded sampling), and checked
once against transformers' own generate(); a draft model identical to the target has nearly
all its drafts accepted, a different one some; neither engine leaks a block; a draft model with
another tokenizer, or one that does not load, is refused with its path named."""

from __future__ import annotations

import shutil

import pytest

from engine_proc import EngineConfig, LLMEngine, SamplingParams
from tests.engine_proc.spec_decode.test_engine_spec import (
    ALPHABET,
    PRESSURE,
    PROMPTS,
    RUN_OF_FOUR,
    assert_transformers_greedy,
    params_list,
    pressure_requests,
    run,
    spec_counts,
)
from tests.tiny_models import tiny_model_dir

SHAPE = dict(num_heads=4, num_kv_heads=2, num_layers=2, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def target_path():
    return tiny_model_dir("llama", **SHAPE)


@pytest.fixture(scope="module")
def other_draft_path():
    """Another random model with the same tokenizer: a quarter of the target's width."""
    return tiny_model_dir("llama", num_heads=2, num_kv_heads=1, num_layers=1, hidden_size=32,
                          intermediate_size=64, max_position_embeddings=1024, seed=7)  # fmt: skip


def make(target, draft=None, k: int = 4, **config) -> LLMEngine:
    config.setdefault("num_kv_blocks", 256)
    config.setdefault("block_size", 4)  # many block boundaries for drafts to cross
    spec = None if draft is None else {"model": str(draft), "num_speculative_tokens": k,
                                       "disable_by_batch_size": 0}  # fmt: skip
    return LLMEngine(EngineConfig(model=str(target), speculative_config=spec, **config))


@pytest.fixture(scope="module")
def plain(target_path):
    return make(target_path)


@pytest.fixture(scope="module")
def with_other(target_path, other_draft_path):
    return make(target_path, other_draft_path)


def draft_engine(engine: LLMEngine) -> LLMEngine:
    return engine.proposer.engine


def assert_draft_pool_free(engine: LLMEngine) -> None:
    draft = draft_engine(engine)
    assert not draft.has_unfinished_requests()
    assert draft.kv.pool.num_free == draft.num_blocks, "the draft engine leaked blocks"


@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": 0},
        {"temperature": 0.8, "top_k": 2, "seed": 5, "repetition_penalty": 1.3, "logprobs": 2},
    ],
    ids=["greedy", "sampled-topk-penalty-logprobs"],
)
def test_same_tokens_as_without_speculation(plain, with_other, kw) -> None:
    prompts = PROMPTS + [PROMPTS[0]]
    drafted, accepted = spec_counts(with_other)
    want = run(plain, prompts, params_list(**kw | {"max_tokens": 25}))
    got = run(with_other, prompts, params_list(**kw | {"max_tokens": 25}))
    for w, g in zip(want, got, strict=True):
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)
        for a, b in zip(g.logprobs, w.logprobs, strict=True):
            assert a.token_id == b.token_id
            assert a.logprob == pytest.approx(b.logprob, abs=1e-3)
    drafted2, accepted2 = spec_counts(with_other)
    assert accepted2 > accepted, "no draft was ever accepted"
    assert drafted2 - drafted > accepted2 - accepted, "no draft was ever rejected"
    assert_draft_pool_free(with_other)


def test_the_target_as_its_own_draft_is_nearly_always_right(target_path, plain) -> None:
    """The same checkpoint proposes what the target then samples (greedy, the same logit_bias):
    the draft runs it with 4-bit weights (the fastest it can), so a near-tie may fall the other
    way and be rejected; most drafts are accepted."""
    engine = make(target_path, target_path)
    prompts = PROMPTS
    params = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                             logit_bias=ALPHABET)] * len(prompts)  # fmt: skip
    got = run(engine, prompts, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in run(plain, prompts, params)]
    drafted, accepted = spec_counts(engine)
    assert drafted > 60 and accepted >= 0.75 * drafted, (accepted, drafted)
    assert_draft_pool_free(engine)


def test_chunked_prefill_prefix_caching_and_preemption(target_path, other_draft_path) -> None:
    base = make(target_path, **PRESSURE)
    spec = make(target_path, other_draft_path, **PRESSURE)
    prompts, params = pressure_requests()
    want = run(base, prompts, params)
    got = run(spec, prompts, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert spec.stats.num_preemptions > 0 and spec.stats.prefix_cache_hits > 0
    drafted, accepted = spec_counts(spec)
    assert 0 < accepted < drafted
    # The draft engine found each sequence's history in its own prefix cache step after step.
    draft = draft_engine(spec)
    assert draft.stats.prefix_cache_hits > 0.5 * draft.stats.prefix_cache_queries
    assert_draft_pool_free(spec)


def test_greedy_matches_transformers(with_other, target_path) -> None:
    assert_transformers_greedy(with_other, target_path, [PROMPTS[1], RUN_OF_FOUR])


def test_opt_out_and_wide_batches_skip_the_draft_model(target_path, other_draft_path) -> None:
    engine = LLMEngine(EngineConfig(
        model=str(target_path), num_kv_blocks=256, block_size=4,
        speculative_config={"model": str(other_draft_path), "disable_by_batch_size": 1}))
    draft = draft_engine(engine)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    run(engine, PROMPTS[:2], [params] * 2)
    run(engine, PROMPTS[:1], [SamplingParams(max_tokens=12, temperature=0, speculative=False)])
    assert engine.stats.spec_decode.num_drafts == 0
    assert draft.stats.prompt_tokens_total == 0  # the draft model never even ran
    run(engine, PROMPTS[:1], [params])
    assert engine.stats.spec_decode.num_drafts > 0


def test_a_draft_with_another_tokenizer_is_refused(target_path, other_draft_path, tmp_path):
    from transformers import AutoTokenizer

    other = tmp_path / "other-tokenizer"
    shutil.copytree(other_draft_path, other)
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<kvscope-only>"])
    tok.save_pretrained(other)
    with pytest.raises(ValueError, match="different tokenizer.*must share the target's"):
        make(target_path, other)
    with pytest.raises(ValueError, match="the draft model '.*nowhere' does not load"):
        make(target_path, tmp_path / "nowhere")


def test_parallel_sampling_forks_draft_each_their_own(plain, with_other) -> None:
    """n = 3: after the fork each sequence is its own request of the draft engine."""
    p = SamplingParams(n=3, max_tokens=20, temperature=1.0, seed=9, logit_bias=ALPHABET,
                       ignore_eos=True)  # fmt: skip
    drafts = with_other.stats.spec_decode.num_drafts
    got = run(with_other, [PROMPTS[1]], [p])
    assert [o.token_ids for o in got] == [o.token_ids for o in run(plain, [PROMPTS[1]], [p])]
    assert len({tuple(o.token_ids) for o in got}) > 1  # the forks sampled apart
    assert with_other.stats.spec_decode.num_drafts > drafts
    assert_draft_pool_free(with_other)
