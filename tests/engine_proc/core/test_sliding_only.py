"""A model whose every layer slides (Mistral with its window): one block table, itself a sliding
group, that releases the blocks that left the window, so a chat far longer than the pool runs.
Checked on a tiny random Mistral against transformers' greedy tokens and the same engine keeping
every block (hybrid_kv=False), by block counts read from telemetry and by a brute-force recount
of every block's references."""

from __future__ import annotations

import functools

import pytest
import torch

from engine_proc import EngineConfig, LLMEngine, SamplingParams
from engine_proc.core.kv_cache_manager import NO_BLOCK, block_hash, root_hash
from engine_proc.core.kv_groups import max_sliding_blocks, plan_layout
from tests.engine_proc.core.random_workloads import check_random_workload, prompt_of
from tests.tiny_models import hf_reference_model, tiny_model_dir

WINDOW = 13
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def mistral_dir():
    return tiny_model_dir("mistral", num_layers=2, num_heads=4, num_kv_heads=2,
                          sliding_window=WINDOW, max_position_embeddings=2048)  # fmt: skip


def _engine(path, hybrid: bool | None = True, **kw) -> LLMEngine:
    config = dict(model=str(path), num_kv_blocks=400, block_size=8, hybrid_kv=hybrid,
                  long_prefill_chunk=24, dtype="float32")  # fmt: skip
    return LLMEngine(EngineConfig(**(config | kw)))


def test_every_layer_sliding_is_one_sliding_group():
    layout = plan_layout(("sliding_attention",) * 4, 4, 16)
    assert layout.windows == (16,) and not layout.is_hybrid and layout.has_sliding_groups
    assert layout.layer_slot == (0, 1, 2, 3) and layout.group_size == 4


def test_greedy_tokens_are_transformers_past_the_window(mistral_dir):
    ref = hf_reference_model(mistral_dir)
    prompts = [prompt_of(1, 40), prompt_of(2, 9)]
    got = _engine(mistral_dir).generate(prompts, GREEDY)
    for prompt, out in zip(prompts, got, strict=True):
        with torch.no_grad():
            want = ref.generate(torch.tensor([prompt]), max_new_tokens=GREEDY.max_tokens,
                                do_sample=False, eos_token_id=None, pad_token_id=0,
                                attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert out.token_ids == want[0, len(prompt):].tolist()  # fmt: skip


def test_a_long_chat_holds_only_its_window(mistral_dir):
    """Read from telemetry: while decoding, the request's table holds at most the window's
    blocks (it may straddle one more); released entries come first; the telemetry counters
    call them sliding-window blocks."""
    engine = _engine(mistral_dir)
    info = engine.model_info()
    assert [g["window"] for g in info["kv_groups"]] == [WINDOW]
    bs = engine.block_size
    engine.add_request("long", prompt_of(0, 120), SamplingParams(max_tokens=40, ignore_eos=True))
    decoded = 0
    while engine.has_unfinished_requests():
        engine.step()
        snap = engine.snapshot()
        (req,) = [r for r in snap.requests if r.request_id == "long"] or [None]
        if req is None:
            continue
        live = [b for b in req.block_table if b != NO_BLOCK]
        assert all(b == NO_BLOCK for b in req.block_table[: len(req.block_table) - len(live)])
        assert snap.counters["kv_blocks_sliding_window"] == len(live)
        assert snap.counters["kv_blocks_full_attention"] == 0
        if req.num_computed_tokens > 120:  # decoding (trimmed before each step)
            decoded += 1
            assert len(live) <= max_sliding_blocks(WINDOW, bs), req.block_table
            assert len(req.block_table) >= -(-req.num_computed_tokens // bs)
    assert decoded > 30
    assert engine.kv.pool.num_free == engine.num_blocks


def test_a_chat_longer_than_the_pool_runs_and_matches_keeping_every_block(mistral_dir):
    """10 blocks of 8 tokens hold 80 tokens; the window's blocks and a chunk's are all a
    sliding table ever holds, so a 300-token prompt and its reply run."""
    prompt = prompt_of(3, 300)
    tight = _engine(mistral_dir, num_kv_blocks=10, long_prefill_chunk=32)
    assert tight.max_total_tokens >= 400
    (got,) = tight.generate([prompt], GREEDY)
    (want,) = _engine(mistral_dir, hybrid=False).generate([prompt], GREEDY)
    assert got.token_ids == want.token_ids
    assert tight.kv.pool.num_free == tight.num_blocks


def test_a_prompt_alone_takes_the_default_chunks_where_the_pool_cannot_take_it_whole(mistral_dir):
    """The default rule gives a prompt alone the whole token budget only where the pool has the
    blocks for it at once: 80 blocks of 8 hold the 512-token default chunk beside the window,
    not 1,500 tokens, so those go in default chunks (and the reply is the keep-everything
    engine's)."""
    prompt = prompt_of(5, 1500)
    engine = _engine(mistral_dir, num_kv_blocks=80, long_prefill_chunk=None,
                     max_num_batched_tokens=2048)  # fmt: skip
    (got,) = engine.generate([prompt], GREEDY)
    steps = [s.num_prefill_tokens for s in engine.stats.steps if s.num_prefill_tokens]
    assert steps == [512, 512, 476]
    (want,) = _engine(mistral_dir, hybrid=False, num_kv_blocks=400).generate([prompt], GREEDY)
    assert got.token_ids == want.token_ids
    assert engine.kv.pool.num_free == engine.num_blocks


def test_a_hit_needs_only_the_last_windows_blocks(mistral_dir):
    """The same prompt again hits up to its last full block, even with the blocks before the
    window gone from the cache; with a block inside the window gone, it hits no further than
    that block. Each time the reply is the cold one."""
    prompt = prompt_of(7, 100)
    engine = _engine(mistral_dir)
    bs = engine.block_size
    (cold,) = engine.generate([prompt], GREEDY)
    last = (len(prompt) - 1) // bs  # blocks a hit may cover
    pool = engine.kv.pool
    by_hash = {b.block_hash: b for b in pool.blocks if b.block_hash is not None}
    chain, parent = [], root_hash(engine.cache_identity, None)
    for i in range(last):
        parent = block_hash(parent, prompt[i * bs : (i + 1) * bs])
        chain.append(parent)
    for h in chain[:3]:  # far below the window of the prompt's end
        pool.uncache(by_hash[h])
    (again,) = engine.generate([prompt], GREEDY)
    assert again.num_cached_tokens == last * bs and again.token_ids == cold.token_ids
    # a block the window of the last full block needs: the hit ends before it
    pool.uncache(pool.blocks[pool.hash_to_block[chain[last - 1]]])
    (third,) = engine.generate([prompt], GREEDY)
    assert third.num_cached_tokens < last * bs and third.token_ids == cold.token_ids


@pytest.mark.parametrize("seed", range(3))
def test_random_workloads_on_tiny_pools_leak_nothing_and_change_no_token(mistral_dir, seed):
    """Shared prefixes, n > 1, aborts, preemption and eviction in a pool of a couple of dozen
    blocks: reference counts against a recount after every step, every block free at the end,
    the replies of a roomy keep-everything engine."""
    check_random_workload(functools.partial(_engine, mistral_dir), seed, (18, 30))


def test_kv_tiers_keep_every_block_unless_told_to_refuse(mistral_dir, tmp_path):
    with pytest.raises(ValueError, match="KV tiers"):
        _engine(mistral_dir, hybrid=True, kv_disk_dir=str(tmp_path))
    kept = _engine(mistral_dir, hybrid=None, kv_disk_dir=str(tmp_path / "auto"))
    assert kept.kv_layout.windows == (None,) and kept.kv.tiers is not None
    prompt = prompt_of(9, 60)
    (got,) = kept.generate([prompt], GREEDY)
    (want,) = _engine(mistral_dir).generate([prompt], GREEDY)
    assert got.token_ids == want.token_ids


def test_a_chunk_raised_live_past_the_pool_still_runs_a_prompt_alone(mistral_dir):
    """max_total_tokens was sized for the 512-token default chunk beside the window; a chunk
    limit lifted live (0 = the whole budget) would ask for more blocks than the pool has, and
    with nothing else running no block would ever come free: the prompt takes what fits."""
    engine = _engine(mistral_dir, num_kv_blocks=80, long_prefill_chunk=None,
                     max_num_batched_tokens=2048)  # fmt: skip
    engine.set_limits(long_prefill_chunk=0)
    prompt = prompt_of(6, 1500)
    engine.add_request("long", prompt, GREEDY)
    outs = []
    for _ in range(200):
        outs += engine.step()
        if not engine.has_unfinished_requests():
            break
    assert outs and outs[-1].finished
    (want,) = _engine(mistral_dir, hybrid=False, num_kv_blocks=400).generate([prompt], GREEDY)
    assert outs[-1].token_ids == want.token_ids
    steps = [s.num_prefill_tokens for s in engine.stats.steps if s.num_prefill_tokens]
    assert sum(steps) == 1500 and max(steps) > 512  # fitted chunks, larger than the default
    assert engine.kv.pool.num_free == engine.num_blocks


def test_serve_takes_hybrid_kv_from_the_command_line(mistral_dir):
    import argparse

    from engine_proc.server.cli import add_arguments, build_engine

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    windows = {}
    for choice in ("auto", "on", "off"):
        args = parser.parse_args(["--model", str(mistral_dir), "--num-blocks", "64",
                                  "--hybrid-kv", choice])  # fmt: skip
        windows[choice] = build_engine(args).kv_layout.windows
    assert windows == {"auto": (WINDOW,), "on": (WINDOW,), "off": (None,)}
    with pytest.raises(SystemExit):
        parser.parse_args(["--hybrid-kv", "maybe"])
