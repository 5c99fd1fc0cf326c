"""The fused step's attention of one chunk of a row's keys (engine_proc/native/attention.h,
attention_regs.h): every kernel compiled in (generic, AVX2, AVX-512) against a float64 recount
of the softmax over the paged cache read through a scattered block table, for the head shapes
of the families the engine loads, float32 and float16 caches, a sliding window's first key and
a chunk of the row's blocks."""

from __future__ import annotations

import pytest
import torch

from engine_proc.executor import fused_decode as fd
from tests.engine_proc.executor import extension_builds

# each build: this CPU's, and Haswell's where this CPU has AVX-512 (extension_builds.py)
extension = extension_builds.extension_fixture()

BLOCK = 16

# (query heads, KV heads, head_dim): SmolLM2-135M, Llama 3.2 1B, Qwen3, Gemma 3 1B, one query
# head per KV head, heads of 24 (not a multiple of 32: one register a pass), 5 per KV head
SHAPES = [(9, 3, 64), (32, 8, 64), (16, 8, 128), (4, 1, 256), (4, 4, 32), (6, 2, 24), (10, 2, 16)]


def _case(heads, kv_heads, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    num_blocks = 12
    q = torch.randn(heads, d, generator=g)
    k = (torch.randn(num_blocks, BLOCK, kv_heads, d, generator=g) * 2).to(dtype)
    v = torch.randn(num_blocks, BLOCK, kv_heads, d, generator=g).to(dtype)
    table = torch.randperm(num_blocks, generator=g)[:9].int()  # 9 blocks, scattered
    return q, k, v, table


def _reference(q, k, v, table, seq_len, first_key, b0, b1, scale):
    """float64 max, sum of exp(score - max) and sum of exp(score - max) * value per head over
    keys [max(first_key, b0 * BLOCK), min(seq_len, b1 * BLOCK))."""
    heads, d = q.shape
    kv_heads = k.shape[2]
    keys = k[table.long()].reshape(-1, kv_heads, d).double()  # logical order
    values = v[table.long()].reshape(-1, kv_heads, d).double()
    lo, hi = max(first_key, b0 * BLOCK), min(seq_len, b1 * BLOCK)
    kv_of = torch.arange(heads) // (heads // kv_heads)
    kh, vh = keys[lo:hi, kv_of], values[lo:hi, kv_of]  # [n, heads, d]
    scores = torch.einsum("hd,nhd->hn", q.double(), kh) * scale
    m = scores.max(-1).values
    w = torch.exp(scores - m[:, None])
    return m, w.sum(-1), torch.einsum("hn,nhd->hd", w, vh)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_every_kernel_attends_as_the_float64_recount(extension, shape, dtype):
    heads, kv_heads, d = shape
    q, k, v, table = _case(heads, kv_heads, d, dtype, seed=d + heads)
    scale = d**-0.5
    # whole rows (a partial last block), a sliding window's first key inside a block, and a
    # middle chunk of blocks (as a long row is split among threads)
    cases = [(137, 0, 0, 9), (5, 0, 0, 1), (140, 45, 2, 9), (130, 0, 3, 6)]
    for seq_len, first_key, b0, b1 in cases:
        m_ref, s_ref, acc_ref = _reference(q, k, v, table, seq_len, first_key, b0, b1, scale)
        out_ref = acc_ref / s_ref[:, None]
        ran = []
        for index, name in enumerate(fd.ATTEND_KERNELS):
            try:
                m, s, acc = extension.attend_chunk_kernel(
                    q, k, v, table, seq_len, first_key, b0, b1, scale, index
                )
            except RuntimeError as e:  # not compiled in on this CPU, or not this head shape
                assert name != "generic" and "not compiled in or does not fit" in str(e)
                continue
            ran.append(name)
            # float32 sums of up to 256 products and 140 weights; exp to 2e-7 relative
            assert torch.allclose(m.double(), m_ref, rtol=1e-5, atol=1e-5), name
            assert torch.allclose(s.double(), s_ref, rtol=1e-5), name
            out = acc.double() / s.double()[:, None]
            assert torch.allclose(out, out_ref, rtol=1e-4, atol=1e-5), name
        assert "generic" in ran
        # AVX2's kernel fits every head of a multiple of 8 floats (AVX-512's: 16, 32 or 64
        # with up to 4 query heads per KV head), so an x86 build checks it on every shape
        assert "avx2" in ran or not extension.has_avx2()


def test_heads_the_avx2_kernel_does_not_fit_run_the_generic_one(extension):
    if not extension.has_avx2():
        pytest.skip("not an AVX2 build: the generic kernel runs")
    avx2 = fd.ATTEND_KERNELS.index("avx2")
    q, k, v, table = _case(4, 2, 20, torch.float32, seed=2)  # 20 floats: not a multiple of 8
    with pytest.raises(RuntimeError, match="does not fit heads of 20"):
        extension.attend_chunk_kernel(q, k, v, table, 100, 0, 0, 7, 0.2, avx2)
    generic = extension.attend_chunk_kernel(q, k, v, table, 100, 0, 0, 7, 0.2, 0)
    assert torch.isfinite(generic[2]).all()


def test_bad_arguments_name_what_is_wrong(extension):
    q, k, v, table = _case(4, 2, 32, torch.float32, seed=3)
    with pytest.raises(RuntimeError, match="kernel must be 0"):
        extension.attend_chunk_kernel(q, k, v, table, 50, 0, 0, 4, 0.1, 3)
    with pytest.raises(RuntimeError, match="blocks"):
        extension.attend_chunk_kernel(q, k, v, table, 50, 0, 4, 2, 0.1, 0)
