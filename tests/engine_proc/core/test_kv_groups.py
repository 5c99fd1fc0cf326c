"""The hybrid KV cache: layers grouped by attention type, a block table per group, sliding groups
releasing what left the window. Checked on a tiny random Gemma 3 (five sliding layers, one
global, as Gemma 3 interleaves them) against the same engine with every block kept
(hybrid_kv=False, itself checked against transformers in tests/engine_proc/models/), by block
counts read from telemetry and by a brute-force recount of every block's references."""

from __future__ import annotations

import functools
import math

import pytest

from engine_proc import EngineConfig, LLMEngine, SamplingParams
from engine_proc.core.kv_cache_manager import NO_BLOCK
from engine_proc.core.kv_groups import first_needed_block, max_sliding_blocks, plan_layout
from tests.engine_proc.core.random_workloads import check_random_workload, prompt_of
from tests.tiny_models import tiny_model_dir

SLIDING, FULL = "sliding_attention", "full_attention"
WINDOW = 8
GEMMA_TYPES = (SLIDING,) * 5 + (FULL,)


def test_layouts_group_layers_by_attention_type():
    gemma3_1b = tuple(FULL if i % 6 == 5 else SLIDING for i in range(26))
    layout = plan_layout(gemma3_1b, 26, 512)
    assert layout.group_size == 4 and layout.windows == (None,) + (512,) * 6
    assert layout.layers_of(0) == [5, 11, 17, 23]
    assert sorted(sum((layout.layers_of(g) for g in range(7)), [])) == list(range(26))
    # a layer's slot is unique within its group, and below group_size
    for g in range(7):
        slots = [layout.layer_slot[i] for i in layout.layers_of(g)]
        assert len(set(slots)) == len(slots) and max(slots) < 4
    for types, window in (((FULL,) * 4, None), ((SLIDING,) * 4, 16), (GEMMA_TYPES, None)):
        one = plan_layout(types, len(types), window)
        assert not one.is_hybrid and one.group_size == len(types)


def test_first_needed_block_is_the_window_edge():
    # the next query at position 40 sees positions 33..40: block 2 (32..47) on, with B = 16
    assert first_needed_block(40, 8, 16) == 2 and first_needed_block(7, 8, 16) == 0
    assert first_needed_block(100, 1, 16) == 6  # only itself
    assert max_sliding_blocks(8, 16) == 2 and max_sliding_blocks(32, 16) == 3


@pytest.fixture(scope="module")
def gemma_dir():
    return tiny_model_dir("gemma3", num_layers=6, layer_types=GEMMA_TYPES,
                          sliding_window=WINDOW, max_position_embeddings=1024)  # fmt: skip


def _engine(path, hybrid: bool | None = True, **kw) -> LLMEngine:
    config = dict(model=str(path), num_kv_blocks=400, block_size=16, hybrid_kv=hybrid,
                  long_prefill_chunk=24)  # fmt: skip
    return LLMEngine(EngineConfig(**(config | kw)))


def test_a_long_request_holds_its_window_in_each_sliding_group(gemma_dir):
    engine = _engine(gemma_dir)
    info = engine.model_info()
    assert [g["window"] for g in info["kv_groups"]] == [None] + [WINDOW] * 5
    assert info["kv_groups"][0]["layers"] == [5]
    bs = engine.block_size
    engine.add_request("long", prompt_of(0, 200), SamplingParams(max_tokens=40, ignore_eos=True))
    seen_decode = False
    while engine.has_unfinished_requests():
        engine.step()
        (req,) = [r for r in engine.snapshot().requests if r.request_id == "long"] or [None]
        if req is None:
            continue
        assert len(req.block_table) == math.ceil(req.num_computed_tokens / bs) or \
            len(req.block_table) == math.ceil((req.num_computed_tokens + 1) / bs)  # fmt: skip
        assert len(req.group_tables) == 5
        for table in req.group_tables:
            live = [b for b in table if b != NO_BLOCK]
            if req.num_computed_tokens >= 200:  # decoding: its window and no more
                seen_decode = True
                assert len(live) <= max_sliding_blocks(WINDOW, bs), table
            assert all(b == NO_BLOCK for b in table[: len(table) - len(live)])  # released first
    assert seen_decode
    assert engine.kv.pool.num_free == engine.num_blocks


def test_hybrid_and_keep_everything_give_the_same_tokens(gemma_dir):
    prompts = [prompt_of(i, n) for i, n in enumerate((60, 130, 17, 200))]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    kept = _engine(gemma_dir, hybrid=False).generate(prompts, params)
    hybrid = _engine(gemma_dir)
    assert [o.token_ids for o in hybrid.generate(prompts, params)] == [o.token_ids for o in kept]
    # the same prompts again: prefix hits (the full group's whole prefix, each sliding group's
    # last window) and the same tokens
    again = hybrid.generate(prompts, params)
    assert [o.token_ids for o in again] == [o.token_ids for o in kept]
    assert sum(o.num_cached_tokens for o in again) > 0


@pytest.mark.parametrize("seed", range(4))
def test_random_workloads_on_tiny_pools_leak_nothing_and_change_no_token(gemma_dir, seed):
    """Random prompts sharing prefixes, n > 1, aborts, preemption and eviction in a pool of a
    few dozen blocks: after every step each block's reference count is the number of tables
    holding it; at the end every block is free; replies are those of a roomy keep-everything
    engine."""
    check_random_workload(functools.partial(_engine, gemma_dir), seed, (40, 60))


def test_what_a_hybrid_cache_cannot_do_yet_keeps_every_block_or_is_refused_by_name(gemma_dir,
                                                                                   tmp_path):
    """KV tiers and fp8 KV need every block: left unset, hybrid_kv keeps them (and says so in
    the log); hybrid_kv=True refuses the combination by name."""
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8'"):
        _engine(gemma_dir, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="KV tiers"):
        _engine(gemma_dir, kv_disk_dir=str(tmp_path))
    for kw in ({"kv_cache_dtype": "fp8"}, {"kv_disk_dir": str(tmp_path / "auto")}):
        auto = _engine(gemma_dir, hybrid=None, **kw)
        assert not auto.kv_layout.has_sliding_groups, kw
        (out,) = auto.generate([prompt_of(1, 40)], SamplingParams(max_tokens=4))
        assert len(out.token_ids) == 4
    _engine(gemma_dir, hybrid=False, kv_disk_dir=str(tmp_path))
    with pytest.raises(ValueError, match="hybrid_kv must be true, false or null"):
        _engine(gemma_dir, hybrid=1)


def test_a_window_covering_the_whole_context_keeps_one_full_group(gemma_dir):
    from engine_proc.catalog.estimate import estimate

    engine = _engine(gemma_dir, hybrid=None, max_model_len=WINDOW)
    assert engine.kv_layout.windows == (None,)
    # the Models dialog's estimate at that context takes the same layout
    assert not estimate(engine.model_config, 1, context=WINDOW).hybrid
    assert estimate(engine.model_config, 1, context=4 * WINDOW).hybrid


def test_a_hit_needs_each_sliding_groups_last_window(gemma_dir):
    """The full group keeps a prompt's whole prefix but the sliding groups' copies are gone
    (evicted: they leave the window, so they go first): no block of that prefix may be reused,
    and the reply is the cold one."""
    prompt = prompt_of(7, 150)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    engine = _engine(gemma_dir)
    (cold,) = engine.generate([prompt], params)
    pool = engine.kv.pool
    for block in pool.blocks:
        if block.block_hash is not None and not block.recorded:  # a sliding group's copy
            pool.uncache(block)
    assert any(b.block_hash is not None for b in pool.blocks)  # the full group's are still there
    (again,) = engine.generate([prompt], params)
    assert again.num_cached_tokens == 0 and again.token_ids == cold.token_ids
    # with the sliding copies there, the same prompt hits up to its last full block
    (third,) = engine.generate([prompt], params)
    assert third.num_cached_tokens == (len(prompt) - 1) // 16 * 16
    assert third.token_ids == cold.token_ids
