"""Soft-capped attention (Gemma 2) in the torch backend against a plain float64 recount: per
sequence and query token, scores = q.k * scale, capped as cap * tanh(scores / cap), masked to
the causal (and window) range, softmax, weighted sum of V. Decode rows, prompt chunks over
cached context and fresh prompts in one batch; GQA and MQA; with and without a window."""

from __future__ import annotations

import math

import pytest
import torch

from engine_proc.attention.torch_ref import TorchAttentionBackend
from tests.engine_proc.attention.test_triton_backend import make_batch

# (query_len, seq_len): decode rows of unequal lengths, a chunk over cached context, a fresh prompt
SPECS = [(1, 37), (9, 30), (1, 20), (13, 13)]


def recount(query, k_cache, v_cache, meta, scale, cap, window):
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    out = torch.zeros(query.shape, dtype=torch.float64)
    row = 0
    for s, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
        blocks = meta.block_tables[s].tolist()
        for i in range(q_len):
            pos = seq_len - q_len + i
            first = 0 if window is None else max(0, pos - window + 1)
            for h in range(query.shape[1]):
                q = query[row, h].double()
                scores, values = [], []
                for p in range(first, pos + 1):
                    blk, off = blocks[p // block_size], p % block_size
                    k = k_cache[blk, off, h // group].double()
                    x = float(q @ k) * scale
                    scores.append(cap * math.tanh(x / cap) if cap else x)
                    values.append(v_cache[blk, off, h // group].double())
                top = max(scores)
                weights = [math.exp(x - top) for x in scores]
                total = sum(weights)
                out[row, h] = sum(w / total * v for w, v in zip(weights, values, strict=True))
            row += 1
    return out


@pytest.mark.parametrize("num_kv_heads", [2, 1])
@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("cap", [2.0, 0.7])
def test_softcapped_attention_matches_a_float64_recount(num_kv_heads, window, cap):
    query, k_cache, v_cache, meta = make_batch(
        SPECS, block_size=7, num_heads=4, num_kv_heads=num_kv_heads, head_dim=16,
        dtype=torch.float32,
    )  # fmt: skip
    # finite garbage where nothing may be read (make_batch leaves NaN there, which a product
    # with a zero weight would spread)
    k_cache, v_cache = k_cache.nan_to_num(1e3), v_cache.nan_to_num(-1e3)
    query = query * 3  # scores of std ~3 * 4 * 0.25: well into the cap's bend
    scale = 0.25
    backend = TorchAttentionBackend()
    ours = backend.forward(query, k_cache, v_cache, meta, scale, window, softcap=cap)
    ref = recount(query, k_cache, v_cache, meta, scale, cap, window)
    torch.testing.assert_close(ours.double(), ref, atol=2e-5, rtol=1e-5)
    # the cap is what makes them agree: uncapped attention is far off
    plain = backend.forward(query, k_cache, v_cache, meta, scale, window)
    assert (plain.double() - ref).abs().max() > 0.05
