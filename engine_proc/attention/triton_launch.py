"""Launch planning for the Triton kernels: input checks, compile-time constants, grids, and the
pointers a (possibly quantised) KV layer hands the kernels.

``attention_constants`` and ``write_kv_constants`` are the single source of launch constants:
``TritonAttentionBackend`` launches with them and ``triton_aot`` compiles exactly those variants
for GPUs this machine does not have.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from engine_proc.attention.base import AttentionMetadata
from engine_proc.attention.kv_fp8 import FP8_DTYPE, LAYER_SCALE_DTYPE, Fp8KV
from engine_proc.attention.kv_quant import SCALE_DTYPE, QuantizedKV
from engine_proc.attention.triton_attention_kernel import INTERPRETED
from engine_proc.attention.triton_kv_codec import KV_FORMATS, triton

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_POOL_DTYPES = {"auto": SUPPORTED_DTYPES, "int8": (torch.int8,), "fp8": (FP8_DTYPE,)}
_LAYER_TYPES = {"auto": "a torch.Tensor", "int8": "a QuantizedKV", "fp8": "an Fp8KV"}


@dataclass(slots=True)
class KVOperands:
    """What the kernels read of one layer's K or V cache."""

    data: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]; fp8 as uint8
    scale: torch.Tensor  # int8: per-slot float16 scales; fp8: one float32; auto: data (unread)


def kv_operands(name: str, cache: Any, kv_cache_dtype: str) -> KVOperands:
    """The tensors behind a layer's cache object, checked against the backend's format."""
    wanted = {"auto": torch.Tensor, "int8": QuantizedKV, "fp8": Fp8KV}[kv_cache_dtype]
    if not isinstance(cache, wanted):
        raise ValueError(
            f"{name} must be {_LAYER_TYPES[kv_cache_dtype]} for kv_cache_dtype="
            f"{kv_cache_dtype!r}, got {type(cache).__name__}"
        )
    data = cache if kv_cache_dtype == "auto" else cache.data
    if data.dtype not in _POOL_DTYPES[kv_cache_dtype]:
        raise ValueError(
            f"{name} dtype must be one of {_POOL_DTYPES[kv_cache_dtype]} for kv_cache_dtype="
            f"{kv_cache_dtype!r}, got {data.dtype}"
        )
    if kv_cache_dtype == "auto":
        return KVOperands(cache, cache)
    scale = cache.scale
    if kv_cache_dtype == "int8":
        if scale.dtype != SCALE_DTYPE or scale.shape != data.shape[:-1] or scale.stride(-1) != 1:
            raise ValueError(
                f"{name} scales must be float16 [num_blocks, block_size, num_kv_heads] "
                f"contiguous in the head dimension, got {scale.dtype} {tuple(scale.shape)}"
            )
        return KVOperands(data, scale)
    if scale.dtype != LAYER_SCALE_DTYPE or scale.numel() != 1:
        raise ValueError(
            f"{name} scale must be one float32 value, got {scale.dtype} {tuple(scale.shape)}"
        )
    return KVOperands(data.view(torch.uint8), scale)


def scale_strides(k: KVOperands, v: KVOperands, kv_cache_dtype: str) -> tuple[int, int]:
    """(block, slot) strides of the int8 scale tensors, which K and V must share; 0 otherwise."""
    if kv_cache_dtype != "int8":
        return 0, 0
    if k.scale.stride()[:2] != v.scale.stride()[:2]:
        raise ValueError(
            f"K and V scale tensors must share a layout, got strides {k.scale.stride()} and "
            f"{v.scale.stride()}"
        )
    return k.scale.stride(0), k.scale.stride(1)


def check_cache(name: str, cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
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


def check_same_device(**tensors: torch.Tensor) -> None:
    # A kernel handed pointers from two devices would fault (or, interpreted, misread) instead
    # of raising, so catch it here.
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")


def launch_plan(
    query: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata, kv_cache_dtype: str
) -> tuple[dict[str, int | str | bool], tuple[int, int], torch.Tensor]:
    """Checked metadata -> (launch constants, grid, block tables) of one step's attention."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    num_seqs = meta.num_seqs
    check_same_device(
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
        query.dtype, num_heads // num_kv_heads, head_dim, k_cache.shape[1], meta.max_query_len,
        kv_cache_dtype,
    )  # fmt: skip
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
    dtype: torch.dtype,
    group: int,
    head_dim: int,
    block_size: int,
    max_query_len: int,
    kv_cache_dtype: str = "auto",
) -> dict[str, int | str | bool]:
    """The compile-time constants (and warp count) of one paged-attention launch: what
    ``forward`` passes, and what the ahead-of-time compile check (``triton_aot``) builds for a
    GPU it does not have. Warp counts chosen from ptxas' report: 8 warps where 4 spill, and for
    quantised decode, whose 4-warp build holds 128-168 registers per thread on sm_80/sm_90
    (80-116 with 8; untimed on a GPU so far).

    A float32 model over an int8 / fp8 pool takes tf32 products: the pool's codes are exact in
    tf32, only the query and P round (2**-11 relative, an eighth of int8's own rounding), and
    the ieee build spilled 0.4-1.2 KB per thread (255 registers) on sm_80 and sm_90."""
    block_m = _pick_block_m(dtype, group, max_query_len)
    quantised = kv_cache_dtype != "auto"
    return {
        "GROUP": group,
        "HEAD_DIM": head_dim,
        "HEAD_DIM_P2": max(16, triton.next_power_of_2(head_dim)),
        "BLOCK_SIZE": block_size,
        "TILE": _pick_tile(block_size),
        "BLOCK_Q": max(1, block_m // group),
        "BLOCK_M": block_m,
        "DOT_PRECISION": "ieee" if dtype == torch.float32 and not quantised else "tf32",
        "DOT_IN_FP32": INTERPRETED and dtype == torch.bfloat16,
        "KV_FORMAT": KV_FORMATS[kv_cache_dtype],
        "num_warps": 4 if max_query_len == 1 and dtype != torch.float32 and not quantised else 8,
    }


@functools.cache
def write_kv_constants(
    num_kv_heads: int, head_dim: int, block_size: int, kv_cache_dtype: str = "auto"
) -> dict[str, int]:
    return {
        "NUM_KV_HEADS": num_kv_heads,
        "HEAD_DIM": head_dim,
        "BLOCK_SIZE": block_size,
        "HEADS_P2": triton.next_power_of_2(num_kv_heads),
        "HEAD_DIM_P2": triton.next_power_of_2(head_dim),
        "KV_FORMAT": KV_FORMATS[kv_cache_dtype],
    }
