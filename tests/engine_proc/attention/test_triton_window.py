"""The Triton attention kernel with sliding windows (Gemma 2/3, Mistral) and attention logit
soft-capping (Gemma 2), against a brute-force float64 reference and the torch backend. The blocks
wholly before a sequence's first query's window are released as the KV cache manager releases
them (-1 in the table) and their slots hold NaN: a kernel that reads one fails."""

from __future__ import annotations

import math

import pytest
import torch

from engine_proc.attention import torch_ref
from engine_proc.attention.triton_backend import TritonAttentionBackend
from tests.engine_proc.attention.test_triton_backend import TOLERANCES, make_batch

# decode after a long context, a chunk over cached context, a fresh prompt longer than the
# window, a short one inside it
SPECS = [(1, 70), (9, 61), (40, 40), (3, 5)]


def release_before_window(k_cache, v_cache, meta, window: int) -> None:
    """Every block before the first query's window start: -1 in the table, NaN in the pool."""
    bs = k_cache.shape[1]
    for s, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu,
                                             strict=True)):  # fmt: skip
        first = max(0, seq_len - q_len - window + 1) // bs
        for i in range(first):
            block = int(meta.block_tables[s, i])
            k_cache[block] = float("nan")
            v_cache[block] = float("nan")
            meta.block_tables[s, i] = -1


def reference(query, k_cache, v_cache, meta, scale, window=None, softcap=None):
    bs = k_cache.shape[1]
    group = query.shape[1] // k_cache.shape[2]
    tables = meta.block_tables.cpu().tolist()
    q_all, k_all, v_all = query.cpu().double(), k_cache.cpu().double(), v_cache.cpu().double()
    out = torch.zeros(q_all.shape, dtype=torch.float64)
    start = 0
    for s, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu,
                                             strict=True)):  # fmt: skip
        first = 0 if window is None else max(0, seq_len - q_len - window + 1)
        pos = range(first, seq_len)
        k = torch.stack([k_all[tables[s][p // bs], p % bs] for p in pos])
        v = torch.stack([v_all[tables[s][p // bs], p % bs] for p in pos])
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q_all[start : start + q_len], k) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        k_pos = torch.arange(first, seq_len)[None, :]
        visible = k_pos <= q_pos
        if window is not None:
            visible &= k_pos > q_pos - window
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start : start + q_len] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)
        start += q_len
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("window", "softcap"), [(8, None), (21, None), (33, 50.0),
                                                 (None, 30.0), (16, 2.0)])  # fmt: skip
@pytest.mark.parametrize("block_size", [16, 7])
def test_windows_and_softcap_match_the_reference(block_size, window, softcap, dtype):
    query, k_cache, v_cache, meta = make_batch(SPECS, block_size=block_size, num_heads=6,
                                               num_kv_heads=2, head_dim=64, dtype=dtype)
    if window is not None:
        release_before_window(k_cache, v_cache, meta, window)
    scale = 64**-0.5 * (4.0 if softcap == 2.0 else 1.0)  # scores past the cap, in places
    out = TritonAttentionBackend().forward(query, k_cache, v_cache, meta, scale,
                                           window=window, softcap=softcap)  # fmt: skip
    got = out.cpu().double()
    assert torch.isfinite(got).all(), "NaN: the kernel read a released block"
    want = reference(query, k_cache, v_cache, meta, scale, window, softcap)
    torch.testing.assert_close(got, want, **TOLERANCES[dtype])


def test_the_torch_backend_computes_the_same():
    query, k_cache, v_cache, meta = make_batch(SPECS, block_size=16, num_heads=4,
                                               num_kv_heads=1, head_dim=64,
                                               dtype=torch.float32)  # fmt: skip
    release_before_window(k_cache, v_cache, meta, 13)
    # the torch backend gathers whole blocks of the window and masks: finite padding
    k_cache, v_cache = torch.nan_to_num(k_cache), torch.nan_to_num(v_cache)
    for window, softcap in ((13, None), (13, 20.0)):
        ours = TritonAttentionBackend().forward(query, k_cache, v_cache, meta, 0.125,
                                                window=window, softcap=softcap)  # fmt: skip
        theirs = torch_ref.TorchAttentionBackend().forward(query, k_cache, v_cache, meta, 0.125,
                                                           window, softcap)  # fmt: skip
        torch.testing.assert_close(ours.cpu(), theirs.cpu(), atol=2e-5, rtol=1e-4)


def test_bad_windows_and_caps_are_refused_by_name():
    query, k_cache, v_cache, meta = make_batch([(1, 4)], block_size=16, num_heads=2,
                                               num_kv_heads=2, head_dim=64,
                                               dtype=torch.float32)  # fmt: skip
    backend = TritonAttentionBackend()
    with pytest.raises(ValueError, match="window"):
        backend.forward(query, k_cache, v_cache, meta, 0.1, window=0)
    with pytest.raises(ValueError, match="softcap"):
        backend.forward(query, k_cache, v_cache, meta, 0.1, softcap=-math.inf)
