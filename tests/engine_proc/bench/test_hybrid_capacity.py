"""The hybrid-KV capacity benchmark (engine_proc/bench/hybrid_capacity.py) on a small geometry:
a pool sized for two chats with every block kept runs exactly two at once that way, and at least
twice as many with the sliding layers' blocks released, as the layout's own arithmetic predicts
(a recount from the block size and window, not the engine's); nothing leaks."""

from __future__ import annotations

import pytest

from engine_proc.bench import hybrid_capacity as hc

G = hc.Geometry(num_layers=6, global_every=3, window=32, num_kv_heads=1, head_dim=16)
CONTEXT, CHATS, FULL_CHATS = 256, 5, 2


@pytest.mark.slow
def test_the_hybrid_pool_runs_the_chats_its_layout_predicts():
    checkpoint = hc.random_checkpoint(hc.gemma3_shaped(G, CONTEXT))
    kept = hc.run(checkpoint, G, CONTEXT, CHATS, FULL_CHATS, hybrid_kv=False, chunk=32)
    hybrid = hc.run(checkpoint, G, CONTEXT, CHATS, FULL_CHATS, hybrid_kv=True, chunk=32)
    assert kept.peak_decoding == FULL_CHATS
    # pages of 2 layers (the 2 global ones; the 4 sliding in 2 groups): a pool of
    # 2 chats x 6 layers x 17 blocks = 102 pages; a hybrid chat holds 17 + 2 x (2 + 1) = 23
    blocks = -(-(CONTEXT + 4) // 16)
    pages = FULL_CHATS * 6 * blocks // 2
    per_chat = blocks + 2 * (-(-G.window // 16) + 1)
    # prompts in chunks of 32: while a chunk is computed its sliding layers hold the window and
    # the chunk, so the pool reaches the decoding count (with whole 256-token chunks it stops at 3)
    assert hybrid.peak_decoding == pages // per_chat == 2 * kept.peak_decoding
    assert hc.layer_tokens_per_chat(G, CONTEXT, True) == (2 * 16 + 4 * 3) * 16


@pytest.mark.slow
def test_a_pool_runs_more_chats_when_every_layer_slides():
    """Mistral's layout (--global-every 0): one sliding table per chat, which holds at most its
    window and a chunk while prefilling; the pool for 2 kept chats runs every chat at once."""
    g = hc.Geometry(num_layers=4, global_every=0, window=32, num_kv_heads=1, head_dim=16)
    checkpoint = hc.random_checkpoint(hc.gemma3_shaped(g, CONTEXT))
    kept = hc.run(checkpoint, g, CONTEXT, CHATS, FULL_CHATS, hybrid_kv=False, chunk=32)
    sliding = hc.run(checkpoint, g, CONTEXT, CHATS, FULL_CHATS, hybrid_kv=True, chunk=32)
    assert kept.peak_decoding == FULL_CHATS
    # a pool of 2 x 17 blocks (pages of all 4 layers); a decoding chat holds 2 + 1 blocks
    assert hc.layer_tokens_per_chat(g, CONTEXT, True) == 4 * 3 * 16
    assert sliding.peak_decoding == CHATS


def test_the_benchmark_worker_sizes_a_hybrid_pool_for_every_request_at_once():
    """engine_proc/bench/kvscope.py sizes the pool to hold a workload's requests at full length
    together; a hybrid cache keeps a table per group of layers (and a reserve per sliding
    group), so one table's worth would not even fit one request."""
    import argparse

    from engine_proc.bench import kvscope as kb

    checkpoint = hc.random_checkpoint(hc.gemma3_shaped(G, CONTEXT))
    reqs = [{"prompt": list(range(3, 32)), "max_tokens": 128} for _ in range(4)]
    args = argparse.Namespace(model="unused", dtype="float32", threads=1, device="cpu",
                              kv_blocks=None, cache_dir=None)  # fmt: skip
    config = kb.engine_config_for("kvscope", {"requests": reqs}, args)
    engine = kb._build(config, args, checkpoint)
    groups = engine.kv_layout.num_groups
    assert groups > 1
    per_table = -(-(29 + 128) // engine.block_size)  # recounted: blocks of one request's table
    assert engine.max_total_tokens >= 29 + 128
    assert engine.num_blocks >= len(reqs) * per_table * groups
