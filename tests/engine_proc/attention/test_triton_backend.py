"""Triton attention backend against a brute-force float64 reference.

Without a GPU the kernels run through Triton's interpreter on CPU, which must be switched on
before the backend module is imported (Triton picks compiled vs interpreted at decoration time):
tests/conftest.py does. Without triton (a declared test dependency) the module fails on Linux.
"""

from __future__ import annotations

import pytest
import torch

from engine_proc.attention import torch_ref, triton_backend
from engine_proc.attention.base import AttentionMetadata
from engine_proc.attention.triton_backend import TritonAttentionBackend, is_triton_usable
from tests.needs import triton_device

DEVICE = torch.device(triton_device())  # fails on Linux without triton (a test dependency)
HAS_CUDA = DEVICE.type == "cuda"

# Output tolerance per dtype: fp32 is ieee on both paths; fp16/bf16 round the softmax weights
# to the input dtype before P @ V (as every flash-style kernel does).
TOLERANCES = {
    torch.float32: dict(atol=2e-5, rtol=1e-4),
    torch.float16: dict(atol=4e-3, rtol=4e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}


# ------------------------------------------------------------------------------------------------
# Scenario construction and the brute-force reference (shared by no backend)


def make_batch(
    specs: list[tuple[int, int]],  # (query_len, seq_len) per sequence
    *,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device = DEVICE,
    extra_blocks: int = 3,
    pad_columns: int = 2,
    seed: int = 0,
):
    """A cache whose used slots hold random K/V and everything else NaN, scattered blocks."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-seq_len // block_size) for _, seq_len in specs]
    num_blocks = sum(blocks_needed) + extra_blocks
    perm = torch.randperm(num_blocks, generator=gen).tolist()  # non-contiguous, shuffled blocks
    max_blocks = max(blocks_needed) + pad_columns  # always some -1 padding at the end
    block_tables = torch.full((len(specs), max_blocks), -1, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # NaN everywhere a kernel must not read: unused blocks and the tail of each last block.
    k_cache = torch.full(shape, float("nan"), dtype=torch.float32)
    v_cache = torch.full(shape, float("nan"), dtype=torch.float32)
    for s, (_, seq_len) in enumerate(specs):
        ids = [perm.pop() for _ in range(blocks_needed[s])]
        block_tables[s, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        for pos in range(seq_len):
            blk, off = ids[pos // block_size], pos % block_size
            k_cache[blk, off] = torch.randn(num_kv_heads, head_dim, generator=gen)
            v_cache[blk, off] = torch.randn(num_kv_heads, head_dim, generator=gen)
    num_tokens = sum(q for q, _ in specs)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    query_lens = [q for q, _ in specs]
    seq_lens = [s for _, s in specs]
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    slots = []
    for s, (q, sl) in enumerate(specs):
        for pos in range(sl - q, sl):
            slots.append(int(block_tables[s, pos // block_size]) * block_size + pos % block_size)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
    )
    return (
        query.to(device=device, dtype=dtype),
        k_cache.to(device=device, dtype=dtype),
        v_cache.to(device=device, dtype=dtype),
        meta,
    )


def reference_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Per sequence: gather K/V position by position, causal mask, plain float64 softmax."""
    block_size = k_cache.shape[1]
    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    tables = meta.block_tables.cpu().tolist()
    q_all = query.cpu().double()
    k_all, v_all = k_cache.cpu().double(), v_cache.cpu().double()
    out = torch.zeros(q_all.shape, dtype=torch.float64)
    start = 0
    for s, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
        keys, values = [], []
        for pos in range(seq_len):
            blk = tables[s][pos // block_size]
            assert blk >= 0
            keys.append(k_all[blk, pos % block_size])
            values.append(v_all[blk, pos % block_size])
        k = torch.stack(keys).repeat_interleave(group, dim=1)  # [seq_len, H, D]
        v = torch.stack(values).repeat_interleave(group, dim=1)
        q = q_all[start : start + q_len]  # [q_len, H, D]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len)
        visible = torch.arange(seq_len)[None, :] <= q_pos[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start : start + q_len] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)
        start += q_len
    return out


def check(spec, *, block_size, group, head_dim, dtype, num_kv_heads=None, seed=0):
    num_kv_heads = num_kv_heads or (1 if group == 8 else 2)
    query, k_cache, v_cache, meta = make_batch(
        spec,
        block_size=block_size,
        num_heads=num_kv_heads * group,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        seed=seed,
    )
    scale = head_dim**-0.5
    out = TritonAttentionBackend().forward(query, k_cache, v_cache, meta, scale)
    assert out.shape == query.shape and out.dtype == dtype
    ref = reference_attention(query, k_cache, v_cache, meta, scale)
    got = out.cpu().double()
    assert torch.isfinite(got).all(), "NaN/inf: the kernel read an unused slot or block"
    torch.testing.assert_close(got, ref, **TOLERANCES[dtype])


# Decode (37 cached incl. this token), a chunk over cached context, a fresh prompt.
MIXED = [(1, 37), (9, 40), (13, 13)]


# ------------------------------------------------------------------------------------------------
# Interpreter (or GPU) tests on tiny shapes


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_mixed_batch_matches_reference(block_size, head_dim, group, dtype):
    check(MIXED, block_size=block_size, group=group, head_dim=head_dim, dtype=dtype)


@pytest.mark.parametrize(("block_size", "head_dim"), [(12, 64), (16, 80), (64, 64)])
def test_unusual_block_sizes_and_head_dims(block_size, head_dim):
    # Tiles need not align with blocks (12), head_dim is padded to a power of 2 (80), and a
    # block larger than a tile is walked in several tiles (64).
    check(MIXED, block_size=block_size, group=3, head_dim=head_dim, dtype=torch.float32)


@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_only_batch(block_size):
    # max_query_len == 1 takes the small-tile decode configuration.
    spec = [(1, 1), (1, 17), (1, 40)]
    check(spec, block_size=block_size, group=3, head_dim=64, dtype=torch.float32)


def test_long_chunk_spans_several_query_blocks():
    # 38 query tokens over 2 cached ones. GQA 8 packs 8 tokens per program (five query blocks,
    # the last partial); GQA 3 packs 21 (two blocks), after a sequence that shifts the layout.
    check([(38, 40)], block_size=16, group=8, head_dim=64, dtype=torch.float32)
    check([(3, 5), (38, 40)], block_size=32, group=3, head_dim=64, dtype=torch.float32)


def test_block_table_padding_rows_are_never_read():
    # A sequence whose table is mostly -1, next to a longer one, plus a garbage
    # (out-of-pool) entry after the -1 padding that must not be followed either.
    query, k_cache, v_cache, meta = make_batch(
        [(1, 3), (5, 33)],
        block_size=16,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        dtype=torch.float32,
        pad_columns=3,
    )
    meta.block_tables[0, -1] = 10_000
    out = TritonAttentionBackend().forward(query, k_cache, v_cache, meta, 0.125)
    ref = reference_attention(query, k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(out.cpu().double(), ref, **TOLERANCES[torch.float32])


def test_first_token_of_a_sequence():
    # A one-token sequence (seq_len 1) sees only itself.
    check([(1, 1)], block_size=16, group=1, head_dim=64, dtype=torch.float16)


def test_padding_tokens_after_the_last_sequence_are_ignored():
    # Batches padded to a fixed token count (CUDA graphs) carry tokens no sequence owns.
    query, k_cache, v_cache, meta = make_batch(
        [(1, 20), (1, 5)],
        block_size=16,
        num_heads=2,
        num_kv_heads=1,
        head_dim=64,
        dtype=torch.float32,
    )
    padded = torch.cat([query, torch.randn(5, 2, 64).to(query)])
    out = TritonAttentionBackend().forward(padded, k_cache, v_cache, meta, 0.125)
    ref = reference_attention(query, k_cache, v_cache, meta, 0.125)
    assert out.shape == padded.shape
    torch.testing.assert_close(out[:2].cpu().double(), ref, **TOLERANCES[torch.float32])


def test_write_kv_matches_indexing_and_skips_minus_one():
    gen = torch.Generator().manual_seed(1)
    num_blocks, block_size, h_kv, d = 4, 16, 3, 64
    k_cache = torch.randn(num_blocks, block_size, h_kv, d, generator=gen).to(DEVICE)
    v_cache = torch.randn(num_blocks, block_size, h_kv, d, generator=gen).to(DEVICE)
    # K/V as the model produces them: strided views into one fused projection output.
    fused = torch.randn(6, 2 * h_kv * d + 5, generator=gen).to(DEVICE)
    key = fused[:, : h_kv * d].view(6, h_kv, d)
    value = fused[:, h_kv * d : 2 * h_kv * d].view(6, h_kv, d)
    assert not key.is_contiguous()
    slots = torch.tensor([5, -1, 16 * 3 + 15, 0, -1, 33], dtype=torch.int64, device=DEVICE)
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expect_k[slot // block_size, slot % block_size] = key[t]
            expect_v[slot // block_size, slot % block_size] = value[t]
    TritonAttentionBackend().write_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expect_k)
    assert torch.equal(v_cache, expect_v)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_write_kv_low_precision_then_attention(dtype):
    # Fill the cache through write_kv (all tokens of a fresh prompt), then read it back.
    query, k_cache, v_cache, meta = make_batch(
        [(7, 7)], block_size=16, num_heads=2, num_kv_heads=1, head_dim=64, dtype=dtype
    )
    gen = torch.Generator().manual_seed(3)
    key = torch.randn(7, 1, 64, generator=gen).to(device=DEVICE, dtype=dtype)
    value = torch.randn(7, 1, 64, generator=gen).to(device=DEVICE, dtype=dtype)
    backend = TritonAttentionBackend()
    backend.write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
    blk = int(meta.block_tables[0, 0])
    assert torch.equal(k_cache[blk, :7], key)
    assert torch.equal(v_cache[blk, :7], value)
    assert torch.isnan(k_cache[blk, 7:].float()).all()  # the rest of the block untouched
    out = backend.forward(query, k_cache, v_cache, meta, 0.125)
    ref = reference_attention(query, k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(out.cpu().double(), ref, **TOLERANCES[dtype])


def test_bad_input_raises_value_error():
    query, k_cache, v_cache, meta = make_batch(
        [(2, 5)], block_size=16, num_heads=3, num_kv_heads=3, head_dim=64, dtype=torch.float32
    )
    backend = TritonAttentionBackend()
    with pytest.raises(ValueError, match="num_heads"):
        backend.forward(query[:, :2], k_cache, v_cache, meta, 0.125)
    with pytest.raises(ValueError, match="dtype"):
        backend.forward(query.half(), k_cache, v_cache, meta, 0.125)
    with pytest.raises(ValueError, match="one device"):
        backend.forward(query, k_cache.to("meta"), v_cache, meta, 0.125)
    with pytest.raises(ValueError, match="slot_mapping"):
        backend.write_kv(query[:1], query[:1], k_cache, v_cache, meta.slot_mapping)


def test_matches_torch_reference_backend():
    query, k_cache, v_cache, meta = make_batch(
        MIXED, block_size=16, num_heads=6, num_kv_heads=2, head_dim=64, dtype=torch.float32
    )
    # The torch backend may gather whole blocks; give it finite padding to stay comparable.
    k_cache = torch.nan_to_num(k_cache)
    v_cache = torch.nan_to_num(v_cache)
    ours = TritonAttentionBackend().forward(query, k_cache, v_cache, meta, 0.125)
    theirs = torch_ref.TorchAttentionBackend().forward(query, k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(ours.cpu(), theirs.cpu(), atol=2e-5, rtol=1e-4)


def test_is_triton_usable_answers_for_cpu_and_cuda():
    assert is_triton_usable(DEVICE)
    if triton_backend.kernels_interpreted():
        assert not is_triton_usable("cuda")
    else:
        assert not is_triton_usable("cpu")


# ------------------------------------------------------------------------------------------------
# Native GPU runs (larger shapes than the interpreter can afford)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
class TestOnCuda:
    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
    @pytest.mark.parametrize("group", [1, 4, 8])
    def test_mixed_batch_large(self, dtype, group):
        spec = [(1, 700), (1, 33), (64, 300), (200, 200), (1, 1), (17, 1025)]
        check(spec, block_size=16, group=group, head_dim=128, dtype=dtype, num_kv_heads=4)

    @pytest.mark.parametrize("block_size", [16, 32, 48])
    def test_block_sizes(self, block_size):
        spec = [(3, 130), (1, 257), (50, 50)]
        check(spec, block_size=block_size, group=3, head_dim=64, dtype=torch.float16)

    def test_write_kv_on_gpu(self):
        test_write_kv_matches_indexing_and_skips_minus_one()
