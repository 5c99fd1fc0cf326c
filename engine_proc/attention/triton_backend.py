"""GPU attention backend: two Triton kernels over the paged KV cache.

- ``write_kv`` scatters this step's K/V rows into their slots (slot -1: write nothing).
- ``forward`` is ONE launch for a whole mixed batch: decode tokens, prompt chunks whose earlier
  context is already cached, and fresh prompts. The program layout follows vLLM's unified
  attention kernel: a 2D grid of (query block of some sequence, KV head). A program finds its
  sequence by binary search over ``query_start_loc`` on the device, so the launch needs no host
  copy of the per-sequence lengths and its grid depends only on the token and sequence counts
  (which keeps it capturable in a CUDA graph).

The module imports without triton (CPU-only installs): the kernels are then simply not defined,
``is_triton_usable`` answers False and constructing the backend raises a clear error.

Tests run the same kernels through Triton's interpreter on CPU: set ``TRITON_INTERPRET=1`` before
this module is imported (Triton decides compiled vs interpreted when a kernel is decorated).
"""

from __future__ import annotations

import functools
import logging
import math

import torch

from engine_proc.attention.base import AttentionMetadata

logger = logging.getLogger(__name__)

try:  # triton is optional: CPU installs use the torch reference backend
    import triton
    import triton.language as tl

    _TRITON_IMPORT_ERROR: Exception | None = None
except Exception as exc:  # any import failure means "no usable triton here"
    triton = None
    tl = None
    _TRITON_IMPORT_ERROR = exc

# Whether the kernels below were decorated in interpreter mode (they then run on host memory);
# set once they exist.
_INTERPRETED = False

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def is_triton_usable(device: torch.device | str) -> bool:
    """True when this backend can run on ``device``.

    Compiled kernels need a CUDA device Triton supports (compute capability 7.5+); interpreted
    kernels (``TRITON_INTERPRET=1`` at import) run on CPU tensors only.
    """
    if triton is None:
        return False
    dev = torch.device(device)
    if _INTERPRETED:
        return dev.type == "cpu"
    if dev.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(dev) >= (7, 5)


def kernels_interpreted() -> bool:
    """True when the kernels run through Triton's interpreter (set at import time)."""
    return _INTERPRETED


if triton is not None:

    @triton.jit
    def _write_kv_kernel(
        key_ptr,  # [num_tokens, num_kv_heads, head_dim], last dim contiguous
        value_ptr,
        k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], last dim contiguous
        v_cache_ptr,
        slot_mapping_ptr,  # [num_tokens]
        key_stride_t,
        key_stride_h,
        value_stride_t,
        value_stride_h,
        kc_stride_b,
        kc_stride_s,
        kc_stride_h,
        vc_stride_b,
        vc_stride_s,
        vc_stride_h,
        NUM_KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        HEADS_P2: tl.constexpr,  # tl.arange needs power-of-2 extents; masks trim the padding
        HEAD_DIM_P2: tl.constexpr,
    ):
        # One program per token: it copies all KV heads of that token, so a token's row is
        # read once and written as one contiguous [heads, head_dim] run of its slot.
        token = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot < 0:  # padding token (or one whose KV must not be stored)
            return
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        heads = tl.arange(0, HEADS_P2)
        dims = tl.arange(0, HEAD_DIM_P2)
        mask = (heads < NUM_KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
        _copy_token_row(
            key_ptr + token * key_stride_t, key_stride_h,
            k_cache_ptr + block * kc_stride_b + offset * kc_stride_s, kc_stride_h,
            heads, dims, mask,
        )  # fmt: skip
        _copy_token_row(
            value_ptr + token * value_stride_t, value_stride_h,
            v_cache_ptr + block * vc_stride_b + offset * vc_stride_s, vc_stride_h,
            heads, dims, mask,
        )  # fmt: skip

    @triton.jit
    def _copy_token_row(src, src_stride_h, dst, dst_stride_h, heads, dims, mask):
        # One token's [heads, head_dim] row, cast to the cache's dtype.
        row = tl.load(src + heads[:, None] * src_stride_h + dims[None, :], mask=mask)
        tl.store(
            dst + heads[:, None] * dst_stride_h + dims[None, :],
            row.to(dst.dtype.element_ty),
            mask=mask,
        )

    @triton.jit
    def _find_seq(query_start_loc_ptr, q_block_idx, num_seqs, BLOCK_Q: tl.constexpr):
        # Sequence s owns the global query blocks starting at query_start_loc[s] // BLOCK_Q + s.
        # That start index strictly increases with s (the "+ s" keeps sequences with zero or few
        # query tokens apart), so the owner is the last s whose start is <= q_block_idx.
        # Typed so the loop-carried values stay int32 tensors even if num_seqs is specialized.
        lo: tl.int32 = 0
        hi: tl.int32 = num_seqs
        while lo < hi:
            mid = (lo + hi) // 2
            start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
            if start <= q_block_idx:
                lo = mid + 1
            else:
                hi = mid
        return lo - 1

    @triton.jit
    def _dot(a, b, DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr):
        # Triton 3.9's interpreter computes tl.dot on bfloat16 operands wrongly (numpy has no
        # bfloat16). There the operands, already holding bfloat16 values, are widened exactly to
        # float32 first; compiled kernels always take the native path.
        if DOT_IN_FP32:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            return tl.dot(a, b, input_precision=DOT_PRECISION)

    # The sequence count and block-table width change every step: specializing on them (== 1,
    # divisible by 16) would JIT-compile new variants while serving.
    @triton.jit(do_not_specialize=["num_seqs", "max_blocks_per_seq", "bt_stride_s"])
    def _paged_attention_kernel(
        out_ptr,  # [num_tokens, num_heads, head_dim]
        query_ptr,  # [num_tokens, num_heads, head_dim], last dim contiguous
        k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], last dim contiguous
        v_cache_ptr,
        block_tables_ptr,  # [num_seqs, max_blocks_per_seq], -1 padded
        seq_lens_ptr,  # [num_seqs]
        query_start_loc_ptr,  # [num_seqs + 1]
        scale_log2,  # softmax scale * log2(e): the softmax runs on exp2, the cheaper unit
        num_seqs,
        max_blocks_per_seq,
        q_stride_t,
        q_stride_h,
        o_stride_t,
        o_stride_h,
        bt_stride_s,
        kc_stride_b,
        kc_stride_s,
        kc_stride_h,
        vc_stride_b,
        vc_stride_s,
        vc_stride_h,
        GROUP: tl.constexpr,  # query heads per KV head (GQA ratio)
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_P2: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,  # tokens per KV block (any positive integer)
        TILE: tl.constexpr,  # keys per online-softmax step, power of 2 (>= 16 for tl.dot)
        BLOCK_Q: tl.constexpr,  # query tokens per program
        BLOCK_M: tl.constexpr,  # rows per program = BLOCK_Q * GROUP rounded up to a power of 2
        DOT_PRECISION: tl.constexpr,  # "ieee" for float32 so fp32 models are not silently tf32
        DOT_IN_FP32: tl.constexpr,  # interpreter + bfloat16 only, see _dot
    ):
        q_block_idx = tl.program_id(0)
        kv_head = tl.program_id(1)

        seq = _find_seq(query_start_loc_ptr, q_block_idx, num_seqs, BLOCK_Q)
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        local_block = q_block_idx - (q_start // BLOCK_Q + seq)
        # The grid is an upper bound on the number of query blocks (so the host never has to
        # read the query lengths); surplus programs of a sequence stop here.
        if local_block * BLOCK_Q >= q_len:
            return
        seq_len = tl.load(seq_lens_ptr + seq)
        context_len = seq_len - q_len  # tokens of this sequence cached before this step

        # Row r of the tile is (query token r // GROUP, query head r % GROUP of this KV head):
        # every query head sharing the KV head rides in the same program, so each K/V tile is
        # loaded once for the whole group instead of GROUP times.
        rows = tl.arange(0, BLOCK_M)
        q_idx = local_block * BLOCK_Q + rows // GROUP  # token index within the sequence's chunk
        head = kv_head * GROUP + rows % GROUP
        row_valid = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
        dims = tl.arange(0, HEAD_DIM_P2)
        dim_valid = dims < HEAD_DIM

        token = (q_start + q_idx).to(tl.int64)
        q = tl.load(
            query_ptr + token[:, None] * q_stride_t + head[:, None] * q_stride_h + dims[None, :],
            mask=row_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )
        q_pos = context_len + q_idx  # absolute position: each row sees keys 0..q_pos

        # Keys past the last query token of this block are invisible to every row: stop there.
        kv_end = context_len + tl.minimum((local_block + 1) * BLOCK_Q, q_len)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max (log2 units)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2(s - m_i)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], dtype=tl.float32)

        keys = tl.arange(0, TILE)
        bt_row = block_tables_ptr + seq.to(tl.int64) * bt_stride_s
        for tile_start in range(0, kv_end, TILE):
            k_pos = tile_start + keys
            in_range = k_pos < kv_end
            logical = k_pos // BLOCK_SIZE
            # Block-table entries past the needed range are -1 padding (or past the row): the
            # mask keeps them from being read, and a -1 that does show up is never dereferenced.
            phys = tl.load(
                bt_row + logical,
                mask=in_range & (logical < max_blocks_per_seq),
                other=-1,
            ).to(tl.int64)
            key_valid = in_range & (phys >= 0)
            phys = tl.where(key_valid, phys, 0)
            in_block = k_pos % BLOCK_SIZE

            k_off = phys * kc_stride_b + in_block * kc_stride_s + kv_head * kc_stride_h
            k = tl.load(  # [HEAD_DIM_P2, TILE]: already transposed for q @ k
                k_cache_ptr + k_off[None, :] + dims[:, None],
                mask=key_valid[None, :] & dim_valid[:, None],
                other=0.0,
            )
            v_off = phys * vc_stride_b + in_block * vc_stride_s + kv_head * vc_stride_h
            v = tl.load(  # [TILE, HEAD_DIM_P2]
                v_cache_ptr + v_off[:, None] + dims[None, :],
                mask=key_valid[:, None] & dim_valid[None, :],
                other=0.0,
            )

            s = _dot(q, k, DOT_PRECISION, DOT_IN_FP32) * scale_log2
            visible = row_valid[:, None] & key_valid[None, :] & (k_pos[None, :] <= q_pos[:, None])
            s = tl.where(visible, s, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            # A row with no visible key so far (padding rows) keeps a max of -inf; subtracting 0
            # instead avoids -inf - -inf = NaN, and its exp2 terms are 0 either way.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_safe[:, None])
            alpha = tl.math.exp2(m_i - m_safe)  # rescales what was accumulated under the old max
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None]
            # P is rounded to the K/V dtype before P @ V, as flash-style kernels do (tensor cores).
            acc += _dot(p.to(v.dtype), v, DOT_PRECISION, DOT_IN_FP32)
            m_i = m_new

        # Every real row sees at least its own key, so l_i > 0 there; padding rows are not stored.
        acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + token[:, None] * o_stride_t + head[:, None] * o_stride_h + dims[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & dim_valid[None, :],
        )

    _INTERPRETED = type(_paged_attention_kernel).__name__ == "InterpretedFunction"


def _check_cache(name: str, cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
    if cache.dim() != 4:
        raise ValueError(
            f"{name} must be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got shape {tuple(cache.shape)}"
        )
    if cache.shape[2] != num_kv_heads or cache.shape[3] != head_dim:
        raise ValueError(
            f"{name} must have num_kv_heads={num_kv_heads} and head_dim={head_dim}, "
            f"got shape {tuple(cache.shape)}"
        )
    if cache.stride(3) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension (head_dim)")
    if cache.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"{name} dtype must be one of {_SUPPORTED_DTYPES}, got {cache.dtype}")


def _check_same_device(**tensors: torch.Tensor) -> None:
    # A kernel handed pointers from two devices would fault (or, interpreted, misread) instead
    # of raising, so catch it here.
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")


def _launch_plan(query: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata):
    """Checked metadata -> (launch constants, grid, block tables) of one step's attention."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    num_seqs = meta.num_seqs
    _check_same_device(
        query=query,
        block_tables=meta.block_tables,
        seq_lens=meta.seq_lens,
        query_start_loc=meta.query_start_loc,
    )
    if meta.block_tables.dim() != 2 or meta.block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables must be [num_seqs={num_seqs}, max_blocks_per_seq], "
            f"got {tuple(meta.block_tables.shape)}"
        )
    if meta.query_start_loc.shape != (num_seqs + 1,) or meta.seq_lens.shape != (num_seqs,):
        raise ValueError(
            f"query_start_loc must be [{num_seqs + 1}] and seq_lens [{num_seqs}], got "
            f"{tuple(meta.query_start_loc.shape)} and {tuple(meta.seq_lens.shape)}"
        )
    consts = attention_constants(
        query.dtype, num_heads // num_kv_heads, head_dim, k_cache.shape[1], meta.max_query_len
    )
    # Upper bound of sum(ceil(query_len / BLOCK_Q)) computable without reading the lengths:
    # each sequence gets at most floor(its tokens / BLOCK_Q) + 1 blocks.
    grid = (num_tokens // int(consts["BLOCK_Q"]) + num_seqs, num_kv_heads)
    block_tables = meta.block_tables
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    return consts, grid, block_tables


def _pick_tile(block_size: int) -> int:
    # One or two whole blocks for the usual sizes 16/32; larger blocks are walked in 64-key
    # steps so a tile of K and V (TILE x head_dim each) stays within registers.
    return 32 if block_size <= 32 else 64


def _pick_block_m(dtype: torch.dtype, group: int, max_query_len: int) -> int:
    # Decode-only batches have one token per sequence: 16 rows (tl.dot's minimum) hold one
    # token's whole head group up to GQA 16. Prefill packs several tokens per program so each
    # K/V tile is reused across them; float32 tiles are twice the registers, so half the rows
    # (ptxas spilled 40 KB per thread at 64 rows x head_dim 128, see triton_aot).
    rows = max(16, triton.next_power_of_2(group))
    if max_query_len > 1:
        rows = max(rows, 32 if dtype == torch.float32 else 64)
    return rows


def attention_constants(
    dtype: torch.dtype, group: int, head_dim: int, block_size: int, max_query_len: int
) -> dict[str, int | str | bool]:
    """The compile-time constants (and warp count) of one paged-attention launch: what
    ``forward`` passes, and what the ahead-of-time compile check (``triton_aot``) builds for a
    GPU it does not have. Warp counts chosen from ptxas' report: 8 warps where 4 spill."""
    block_m = _pick_block_m(dtype, group, max_query_len)
    return {
        "GROUP": group,
        "HEAD_DIM": head_dim,
        "HEAD_DIM_P2": max(16, triton.next_power_of_2(head_dim)),
        "BLOCK_SIZE": block_size,
        "TILE": _pick_tile(block_size),
        "BLOCK_Q": max(1, block_m // group),
        "BLOCK_M": block_m,
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        "DOT_IN_FP32": _INTERPRETED and dtype == torch.bfloat16,
        "num_warps": 8 if max_query_len > 1 or dtype == torch.float32 else 4,
    }


@functools.cache
def write_kv_constants(num_kv_heads: int, head_dim: int, block_size: int) -> dict[str, int]:
    return {
        "NUM_KV_HEADS": num_kv_heads,
        "HEAD_DIM": head_dim,
        "BLOCK_SIZE": block_size,
        "HEADS_P2": triton.next_power_of_2(num_kv_heads),
        "HEAD_DIM_P2": triton.next_power_of_2(head_dim),
    }


class TritonAttentionBackend:
    """Paged attention on the GPU through Triton (see the module docstring)."""

    name = "triton"
    # Launch grids and constants depend only on tensor shapes and max_query_len, and every
    # per-sequence value is read on the device: a decode step can be captured in a CUDA graph.
    graph_safe = True

    def __init__(self) -> None:
        if triton is None:
            raise RuntimeError(
                "the triton attention backend needs the 'triton' package, which failed to import "
                f"({_TRITON_IMPORT_ERROR!r}); install it (pip install triton) or set "
                "attention_backend='torch'"
            )

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        if key.dim() != 3 or value.shape != key.shape:
            raise ValueError(
                "key and value must both be [num_tokens, num_kv_heads, head_dim], "
                f"got {tuple(key.shape)} and {tuple(value.shape)}"
            )
        num_tokens, num_kv_heads, head_dim = key.shape
        _check_cache("k_cache", k_cache, num_kv_heads, head_dim)
        _check_cache("v_cache", v_cache, num_kv_heads, head_dim)
        if k_cache.shape != v_cache.shape:
            raise ValueError(
                f"k_cache and v_cache shapes differ: {tuple(k_cache.shape)} vs "
                f"{tuple(v_cache.shape)}"
            )
        if slot_mapping.dim() != 1 or slot_mapping.shape[0] != num_tokens:
            raise ValueError(
                f"slot_mapping must be [num_tokens={num_tokens}], got {tuple(slot_mapping.shape)}"
            )
        _check_same_device(
            key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping
        )
        if num_tokens == 0:
            return
        # The kernel adds head_dim offsets directly, so the innermost dim must be dense; a
        # strided token/head layout (a slice of a fused qkv output) is fine.
        if key.stride(2) != 1:
            key = key.contiguous()
        if value.stride(2) != 1:
            value = value.contiguous()
        slot_mapping = slot_mapping.contiguous()
        _write_kv_kernel[(num_tokens,)](
            key,
            value,
            k_cache,
            v_cache,
            slot_mapping,
            key.stride(0),
            key.stride(1),
            value.stride(0),
            value.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            v_cache.stride(0),
            v_cache.stride(1),
            v_cache.stride(2),
            **write_kv_constants(num_kv_heads, head_dim, k_cache.shape[1]),
        )

    def forward(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if query.dim() != 3:
            raise ValueError(
                f"query must be [num_tokens, num_heads, head_dim], got {tuple(query.shape)}"
            )
        if query.dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"query dtype must be one of {_SUPPORTED_DTYPES}, got {query.dtype}")
        num_tokens, num_heads, head_dim = query.shape
        num_kv_heads = k_cache.shape[2] if k_cache.dim() == 4 else -1
        _check_cache("k_cache", k_cache, num_kv_heads, head_dim)
        _check_cache("v_cache", v_cache, num_kv_heads, head_dim)
        if k_cache.dtype != query.dtype or v_cache.dtype != query.dtype:
            raise ValueError(
                f"k_cache/v_cache dtype ({k_cache.dtype}/{v_cache.dtype}) must equal the query "
                f"dtype {query.dtype}"
            )
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        _check_same_device(query=query, k_cache=k_cache, v_cache=v_cache)
        num_seqs = meta.num_seqs
        # Every layer of a step launches with the same metadata, constants and grid: check and
        # derive them at the first layer, reuse them for the others.
        key = (query.dtype, query.device, num_tokens, num_heads, num_kv_heads, head_dim,
               k_cache.shape[1])  # fmt: skip
        plan = meta.backend_plan.get(self.name)
        if plan is None or plan[0] != key:
            plan = meta.backend_plan[self.name] = (key, *_launch_plan(query, k_cache, meta))
        _, consts, grid, block_tables = plan

        # Tokens past query_start_loc[-1] (batch padding) belong to no sequence and are left
        # unwritten, like the torch backend leaves them irrelevant.
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
        if num_tokens == 0 or num_seqs == 0:
            return out
        if query.stride(2) != 1:
            query = query.contiguous()
        _paged_attention_kernel[grid](
            out,
            query,
            k_cache,
            v_cache,
            block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            float(scale) * math.log2(math.e),
            num_seqs,
            block_tables.shape[1],
            query.stride(0),
            query.stride(1),
            out.stride(0),
            out.stride(1),
            block_tables.stride(0),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            v_cache.stride(0),
            v_cache.stride(1),
            v_cache.stride(2),
            **consts,
        )
        return out
