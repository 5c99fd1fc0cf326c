"""Engine core II: prefix caching, chunked prefill, preemption, parallel sampling and seeds,
each checked against an independent run or recount. A tiny random model with the default
model's tokenizer and chat template keeps these fast; tests/engine_proc/engine/test_hf_parity.py
covers the default model itself."""

import random

import pytest

from engine_proc import EngineConfig, LLMEngine, SamplingParams
from engine_proc.engine.telemetry_types import BLOCK_CACHED, BLOCK_IN_USE
from tests.engine_fixtures import greedy_reference, sampled_reference
from tests.tiny_models import hf_reference_model, tiny_model_dir


@pytest.fixture(scope="module")
def tiny_path():
    return tiny_model_dir(
        "llama", num_heads=4, num_kv_heads=2, num_layers=2, max_position_embeddings=1024
    )


@pytest.fixture(scope="module")
def default_engine_factory(tiny_path):
    def make(**config):
        config.setdefault("num_kv_blocks", 512)
        return LLMEngine(EngineConfig(model=str(tiny_path), **config))

    return make


@pytest.fixture(scope="module")
def hf_model(tiny_path):
    return hf_reference_model(tiny_path)


@pytest.fixture(scope="module")
def hf_greedy(hf_model):
    return greedy_reference(hf_model)


@pytest.fixture(scope="module")
def hf_sampled(hf_model):
    return sampled_reference(hf_model)


GREEDY = SamplingParams(max_tokens=12, temperature=0)

SYSTEMS = [
    "You are a concise assistant for a hardware store. Answer questions about tools, paint and "
    "garden supplies in two sentences at most, and never invent prices.",
    "You are a friendly tutor who explains mathematics to twelve year olds with small examples "
    "and encouragement.",
    "Reply only in French.",
]
QUESTIONS = [
    "What is a hammer for?",
    "How do I paint a fence?",
    "What is 7 times 8?",
    "Why is the sky blue?",
    "Name a prime number.",
    "What is a fraction?",
    "How do plants grow?",
    "Say hello.",
]


def workload() -> list[list[dict[str, str]]]:
    rng = random.Random(7)
    chats = []
    for i in range(20):
        system = SYSTEMS[i % len(SYSTEMS)]
        chats.append(
            [
                {"role": "system", "content": system},
                {"role": "user", "content": rng.choice(QUESTIONS) + f" (case {i})"},
            ]
        )
    chats += [chats[0], chats[4], chats[4], chats[9]]  # exact repeats of earlier prompts
    return chats


def expected_hits(prompts: list[list[int]], block_size: int) -> int:
    """Brute force: each prompt can reuse every full block it shares, from the start, with any
    earlier prompt (all are admitted in one step, earlier first), keeping its last token."""
    total = 0
    for i, p in enumerate(prompts):
        best = 0
        for q in prompts[:i]:
            lcp = 0
            while lcp < min(len(p), len(q)) and p[lcp] == q[lcp]:
                lcp += 1
            best = max(best, lcp)
        total += min(best, len(p) - 1) // block_size * block_size
    return total


def run_all_at_once(engine, prompts, params=GREEDY) -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return [done[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.slow
def test_prefix_caching_on_and_off_agree_and_hits_match_a_recount(
    default_engine_factory, hf_greedy
):
    chats = workload()
    limits = dict(max_num_seqs=32, max_num_batched_tokens=8192, long_prefill_chunk=0)
    on = default_engine_factory(enable_prefix_caching=True, **limits)
    off = default_engine_factory(enable_prefix_caching=False, **limits)
    prompts = [on.tokenize(c) for c in chats]
    with_cache = run_all_at_once(on, prompts)
    without = run_all_at_once(off, prompts)
    assert with_cache == without
    hits = on.stats.prefix_cache_hits
    assert hits == expected_hits(prompts, on.block_size) > 0
    assert on.stats.prefix_cache_queries == sum(len(p) for p in prompts)
    assert off.stats.prefix_cache_hits == 0
    # Some shared system prompts end inside a block: the hit stops at the last full block.
    assert any(len(on.tokenize(c[:1])) % on.block_size for c in chats)
    for i in (0, 5, 20, 23):
        assert with_cache[i] == hf_greedy(prompts[i], 12)
    # After everything finished, the blocks stay cached (evictable) and are hit again.
    snap = on.snapshot()
    assert (snap.blocks.state == BLOCK_IN_USE).sum() == 0 and (
        snap.blocks.state == BLOCK_CACHED
    ).sum() > 0
    before = on.stats.prefix_cache_hits
    assert run_all_at_once(on, prompts[:1]) == with_cache[:1]
    assert (
        on.stats.prefix_cache_hits - before
        == (len(prompts[0]) - 1) // on.block_size * on.block_size
    )


@pytest.mark.slow
def test_chunk_sizes_give_transformers_outputs_and_mix_chunks_with_decodes(
    default_engine_factory, hf_greedy
):
    chats = workload()[:6]
    expected = None
    for chunk in (1, 7, 16, 64, 0):
        engine = default_engine_factory(
            long_prefill_chunk=chunk, max_num_batched_tokens=96, enable_prefix_caching=False
        )
        prompts = [engine.tokenize(c) for c in chats]
        if expected is None:
            expected = [hf_greedy(p, GREEDY.max_tokens) for p in prompts]
        # Staggered arrivals: later prompts are chunked while earlier ones decode.
        for i in range(2):
            engine.add_request(f"r{i}", prompts[i], GREEDY)
        outs, step = {}, 0
        while engine.has_unfinished_requests() or step < 4:
            if step == 3:
                for i in range(2, 6):
                    engine.add_request(f"r{i}", prompts[i], GREEDY)
            for out in engine.step():
                if out.finished:
                    outs[out.request_id] = out.token_ids
            step += 1
        assert [outs[f"r{i}"] for i in range(6)] == expected, f"chunk {chunk}"
        if chunk in (1, 7, 16):
            mixed = [s for s in engine.stats.steps if s.num_prefill_tokens and s.num_decode_tokens]
            assert mixed, f"no step mixed prompt chunks and decodes at chunk {chunk}"
            assert max(s.num_prefill_tokens for s in engine.stats.steps) <= 6 * chunk


@pytest.mark.slow
def test_tiny_pool_preempts_and_still_gives_the_reference_outputs(
    default_engine_factory, hf_sampled
):
    chats = workload()[:6]
    seed = 1234
    sampled = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=seed)
    greedy = SamplingParams(max_tokens=24, temperature=0)
    params = [greedy, sampled] * 3
    expected = None
    for blocks in (512, 14):
        engine = default_engine_factory(num_kv_blocks=blocks, max_num_seqs=6)
        prompts = [engine.tokenize(c) for c in chats]
        if expected is None:
            # transformers' logits, drawn at (seed, output position): what each request must
            # give whether or not it was preempted and recomputed.
            expected = [hf_sampled(p, sp, seed) for p, sp in zip(prompts, params, strict=True)]
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(f"r{i}", p, sp)
        outs = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outs[out.request_id] = out.token_ids
        assert engine.kv.pool.num_free == blocks
        assert (engine.stats.num_preemptions > 0) == (blocks == 14)
        assert [outs[f"r{i}"] for i in range(6)] == expected, f"{blocks} blocks"


def test_same_seed_same_tokens_whatever_shares_the_batch(default_engine_factory, hf_sampled):
    engine = default_engine_factory()
    chat = [{"role": "user", "content": "Invent a name for a cat."}]
    params = SamplingParams(max_tokens=16, temperature=1.0, top_k=50, seed=99)
    (alone,) = engine.generate([chat], params)
    assert alone.token_ids == hf_sampled(engine.tokenize(chat), params, 99)
    crowd = [[{"role": "user", "content": q}] for q in QUESTIONS[:5]]
    outs = engine.generate(
        crowd[:2] + [chat] + crowd[2:],
        [SamplingParams(max_tokens=20, temperature=0.7)] * 2
        + [params]
        + [SamplingParams(max_tokens=20, temperature=0.7)] * 3,
    )
    assert outs[2].token_ids == alone.token_ids
    (other_seed,) = engine.generate(
        [chat], SamplingParams(max_tokens=16, temperature=1.0, top_k=50, seed=100)
    )
    assert other_seed.token_ids != alone.token_ids


def test_parallel_sampling_shares_prompt_blocks(default_engine_factory, hf_sampled):
    engine = default_engine_factory(block_size=16)
    chat = [{"role": "user", "content": "Write a short poem about rain."}]
    prompt = engine.tokenize(chat)
    assert len(prompt) % 16, "the test needs a partly filled last prompt block"
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=5, n=3)
    engine.add_request("par", prompt, params)
    while not any(len(s.output_token_ids) for s in engine.requests["par"]):
        engine.step()
    seqs = engine.requests["par"]
    assert len(seqs) == 3
    full = len(prompt) // 16
    shared = seqs[0].block_table[:full]
    assert all(s.block_table[:full] == shared for s in seqs)
    assert all(engine.kv.pool.blocks[b].ref_count == 3 for b in shared)
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.index] = out.token_ids
    assert sorted(outs) == [0, 1, 2]
    # Sequence 0 draws from the request's own seed, as a lone request would.
    assert outs[0] == hf_sampled(prompt, SamplingParams(max_tokens=10, temperature=1.0), 5)
    assert len({tuple(t) for t in outs.values()}) > 1
    assert engine.kv.pool.num_free == engine.num_blocks


def test_abort_frees_blocks_at_once_and_others_continue(default_engine_factory):
    engine = default_engine_factory()
    engine.add_request("a", "Once upon a time", SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", "The weather today", SamplingParams(max_tokens=5, ignore_eos=True))
    engine.step()
    (out,) = engine.abort_request("a")
    assert out.finish_reason == "abort"
    assert all(s.request_id == "b" for s in engine.all_sequences())
    used = sum(len(s.block_table) for s in engine.all_sequences())
    assert engine.kv.pool.num_free == engine.num_blocks - used
    finals = []
    while engine.has_unfinished_requests():
        finals += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finals] == ["b"] and len(finals[0].token_ids) == 5


def test_stop_strings_cut_text_and_stream_never_shows_them(default_engine_factory):
    engine = default_engine_factory()
    chat = [{"role": "user", "content": "Count from one to ten in words, separated by commas."}]
    (free,) = engine.generate([chat], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    assert len(free.text) > 20
    stop = free.text[12:15]  # a stop string that first appears after some text has streamed
    assert free.text.index(stop) > 0
    engine.add_request(
        "s", chat, SamplingParams(max_tokens=40, temperature=0, stop=[stop], ignore_eos=True)
    )
    streamed, final = "", None
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed += out.text_delta
            final = out
    assert final.finish_reason == "stop"
    assert streamed == final.text == free.text[: free.text.index(stop)]


def test_snapshot_counts_match_a_recount(default_engine_factory):
    engine = default_engine_factory(num_kv_blocks=64)
    for i in range(3):
        engine.add_request(f"q{i}", QUESTIONS[i], SamplingParams(max_tokens=30, ignore_eos=True))
    for _ in range(4):
        engine.step()
    snap = engine.snapshot()
    seqs = engine.all_sequences()
    in_use = {b for s in seqs for b in s.block_table}
    assert snap.counters["num_blocks_in_use"] == len(in_use)
    assert snap.counters["num_requests_running"] == len(seqs)
    filled = sum(
        min(16, max(0, s.num_computed_tokens - i * 16))
        for s in seqs
        for i in range(len(s.block_table))
    )
    assert snap.counters["kv_token_occupancy"] == pytest.approx(filled / (16 * len(in_use)))
    assert (
        snap.counters["contiguous_kv_bytes"] == 3 * engine.max_model_len * engine.kv_bytes_per_token
    )
    assert {r.request_id for r in snap.requests} == {"q0", "q1", "q2"}
    assert len(snap.token_events) == sum(s.num_output_tokens for s in seqs)
    assert engine.snapshot().token_events == []  # events are handed out once
