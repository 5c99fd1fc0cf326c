"""Speculative decoding on the families with their own KV or rotary rules.

Gemma 3's hybrid KV cache (sliding-window and full layers, each group its own block table):
rejected drafts are rolled back in every group, the sliding groups still release the blocks
that left the window, and the tokens are the plain engine's (greedy and seeded sampling,
n-gram drafts and a draft model), checked once against transformers.

Phi-3 / Phi-4's LongRoPE: a sequence that grows past the original length is recomputed under
the long factors before its next token (scheduler.py), so drafts stop short of that length;
replies that cross it while speculating give the plain engine's and transformers' tokens."""

from __future__ import annotations

import pytest

from engine_proc import EngineConfig, LLMEngine, SamplingParams
from engine_proc.core.kv_groups import max_sliding_blocks
from tests.engine_proc.spec_decode.test_engine_spec import (
    ALPHABET,
    PROMPTS,
    RUN_OF_FOUR,
    SPEC,
    assert_transformers_greedy,
    hf_alphabet_greedy,
    params_list,
    run,
    spec_counts,
)
from tests.tiny_models import tiny_model_dir

WINDOW = 8
GEMMA3 = dict(num_heads=4, num_kv_heads=2, num_layers=4, sliding_window=WINDOW,
              layer_types=("sliding_attention", "sliding_attention", "full_attention",
                           "sliding_attention"), max_position_embeddings=1024)  # fmt: skip


@pytest.fixture(scope="module")
def gemma_path():
    return tiny_model_dir("gemma3", **GEMMA3)


def make(path, spec: dict | None) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), num_kv_blocks=256, block_size=4,
                                  long_prefill_chunk=16,
                                  speculative_config=spec))  # fmt: skip


@pytest.fixture(scope="module")
def engines(gemma_path):
    plain, ngram = make(gemma_path, None), make(gemma_path, SPEC)
    assert ngram.kv_layout.is_hybrid and ngram.proposer is not None
    return plain, ngram


def watch_windows(engine: LLMEngine) -> list[int]:
    """Step the engine's requests to completion, recording after each step the most blocks
    any sliding group of any sequence holds."""
    held = []
    while engine.has_unfinished_requests():
        engine.step()
        held.append(max((sum(b != -1 for b in t) for f in engine.requests.values()
                         for s in f for t in s.group_tables), default=0))  # fmt: skip
    return held


@pytest.mark.parametrize("kw", [{"temperature": 0}, {"temperature": 1.0, "seed": 11}],
                         ids=["greedy", "sampled"])  # fmt: skip
def test_same_tokens_as_without_speculation(engines, kw) -> None:
    plain, ngram = engines
    prompts = PROMPTS + [PROMPTS[0]]
    drafted, accepted = spec_counts(ngram)
    want = run(plain, prompts, params_list(**kw))
    got = run(ngram, prompts, params_list(**kw))  # (run checks no block leaked)
    assert [(g.token_ids, g.text) for g in got] == [(w.token_ids, w.text) for w in want]
    drafted2, accepted2 = spec_counts(ngram)
    assert accepted2 > accepted and drafted2 - drafted > accepted2 - accepted


def test_sliding_groups_keep_releasing_blocks_while_speculating(engines) -> None:
    """A reply far longer than the window: every sliding group holds at most the window's
    blocks plus the step's own (1 + drafts) tokens' after every step."""
    _, ngram = engines
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True, logit_bias=ALPHABET)
    ngram.add_request("long", PROMPTS[0], params)
    held = watch_windows(ngram)
    bs = ngram.block_size
    bound = max_sliding_blocks(WINDOW, bs) + -(-(1 + SPEC["num_speculative_tokens"]) // bs)
    assert max(held) <= bound, (max(held), bound)
    assert ngram.kv.pool.num_free == ngram.num_blocks


def test_a_model_whose_every_layer_slides_rolls_back_its_one_table() -> None:
    """Mistral's window on every layer: drafts are rolled back in its one (sliding) table,
    which keeps releasing blocks, and the tokens are the plain engine's."""
    path = tiny_model_dir("mistral", num_heads=4, num_kv_heads=2, num_layers=2,
                          sliding_window=WINDOW)  # fmt: skip
    plain, ngram = make(path, None), make(path, SPEC)
    assert ngram.kv_layout.windows == (WINDOW,)
    prompts = PROMPTS + [PROMPTS[0]]
    want = run(plain, prompts, params_list(temperature=0))
    got = run(ngram, prompts, params_list(temperature=0))  # (run checks no block leaked)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert spec_counts(ngram)[1] > 0
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True, logit_bias=ALPHABET)
    ngram.add_request("long", PROMPTS[0], params)
    held = []
    while ngram.has_unfinished_requests():
        ngram.step()
        held += [sum(b != -1 for b in s.block_table) for f in ngram.requests.values()
                 for s in f if s.num_computed_tokens > len(PROMPTS[0])]  # fmt: skip
    bs = ngram.block_size
    assert held and max(held) <= max_sliding_blocks(WINDOW, bs) + -(
        -(1 + SPEC["num_speculative_tokens"]) // bs)


def test_greedy_matches_transformers_with_a_draft_model(gemma_path) -> None:
    # the checkpoint as its own draft (run with 4-bit weights where they fit): its own hybrid
    # cache in the draft engine, drafts mostly right
    engine = make(gemma_path, {"model": str(gemma_path), "num_speculative_tokens": 3,
                               "disable_by_batch_size": 0})  # fmt: skip
    assert_transformers_greedy(engine, gemma_path, [PROMPTS[1], RUN_OF_FOUR])
    drafted, accepted = spec_counts(engine)
    assert accepted > 0.5 * drafted > 0, (accepted, drafted)


PHI4_MINI = dict(num_heads=4, num_kv_heads=1, rope_scaling="longrope", partial_rotary_factor=0.75,
                 tie_word_embeddings=True)  # fmt: skip
ORIGINAL = 32  # tiny_models.phi3_longrope's original_max_position_embeddings


@pytest.mark.parametrize("length", [18, 25, ORIGINAL])
def test_longrope_replies_across_the_original_length(length) -> None:
    from tests.tiny_models import hf_reference_model

    path = tiny_model_dir("phi3", **PHI4_MINI)
    plain = LLMEngine(EngineConfig(model=str(path), num_kv_blocks=256, block_size=4,
                                   enable_prefix_caching=False))  # fmt: skip
    spec = LLMEngine(EngineConfig(model=str(path), num_kv_blocks=256, block_size=4,
                                  enable_prefix_caching=False,
                                  speculative_config=SPEC))  # fmt: skip
    assert spec.proposer is not None
    prompt = ([500, 501, 502] * 11)[:length]
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                             logit_bias=ALPHABET, logprobs=1)]  # fmt: skip
    got = run(spec, [prompt], params)
    want = run(plain, [prompt], params)
    assert got[0].token_ids == want[0].token_ids
    # the logprobs too: a draft row past the original length would take the short factors
    # (the bias keeps the tokens; the logprobs show which factors computed them)
    assert [a.logprob for a in got[0].logprobs] == pytest.approx(
        [b.logprob for b in want[0].logprobs], abs=1e-4)
    assert got[0].token_ids == hf_alphabet_greedy(hf_reference_model(path), prompt, 20)
    assert spec.stats.num_preemptions == plain.stats.num_preemptions == (length + 20 > ORIGINAL)
    drafted, accepted = spec_counts(spec)
    assert accepted > 0
