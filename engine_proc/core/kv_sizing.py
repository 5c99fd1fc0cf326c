"""How many bytes the KV pool spends, without torch: per token for a KV element type, per page
(block) of a layout, the pool's block count, and what one request of N tokens holds. The engine
sizes its pool with these (engine_proc/engine/llm_engine.py) and the model catalog estimates
memory with the same ones (engine_proc/catalog/estimate.py)."""

from __future__ import annotations

import math

from engine_proc.core.kv_groups import KVLayout, max_sliding_blocks, plan_layout

KV_CACHE_DTYPES = ("auto", "fp32", "fp16", "int8", "fp8")  # engine_proc.config
FLOAT_POOL_BYTES = {"fp32": 4, "fp16": 2}  # plain float pools of another type than the model's
INT8_SCALE_BYTES = 2  # int8 pools: a float16 scale per token and KV head


def kv_int8_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int) -> int:
    """K and V of one token: int8 values plus a float16 scale per layer and KV head."""
    return 2 * num_layers * num_kv_heads * (head_dim + INT8_SCALE_BYTES)


def kv_fp8_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int) -> int:
    """K and V of one token at 1 byte per value; the per-layer scales (8 bytes a layer for the
    whole pool) are not per token."""
    return 2 * num_layers * num_kv_heads * head_dim


def kv_bytes_per_token(
    kv_cache_dtype: str, num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int
) -> int:
    """Pool bytes of one token's K and V in a given kv_cache_dtype ("auto": the model dtype of
    ``dtype_bytes`` per value)."""
    if kv_cache_dtype == "int8":
        return kv_int8_bytes_per_token(num_layers, num_kv_heads, head_dim)
    if kv_cache_dtype == "fp8":
        return kv_fp8_bytes_per_token(num_layers, num_kv_heads, head_dim)
    if kv_cache_dtype in FLOAT_POOL_BYTES:
        dtype_bytes = FLOAT_POOL_BYTES[kv_cache_dtype]
    elif kv_cache_dtype != "auto":
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def block_bytes(
    kv_cache_dtype: str, layout: KVLayout, num_kv_heads: int, head_dim: int, dtype_bytes: int,
    block_size: int,
) -> int:  # fmt: skip
    """Bytes of one page: block_size tokens of the `layout.group_size` layers a page holds."""
    per_token = kv_bytes_per_token(kv_cache_dtype, layout.group_size, num_kv_heads, head_dim,
                                   dtype_bytes)  # fmt: skip
    return per_token * block_size


def pool_blocks(num_kv_blocks: int | None, kv_cache_memory: int, page_bytes: int) -> int:
    """The pool's block count: `num_kv_blocks` when set, else as many pages as fit in
    `kv_cache_memory` bytes (at least one)."""
    return num_kv_blocks or max(1, kv_cache_memory // page_bytes)


def request_blocks(layout: KVLayout, num_tokens: int, block_size: int) -> int:
    """Pages one request of `num_tokens` tokens holds once computed: every block of its
    full-attention group, and in each sliding group no more than its window spans
    (core/kv_groups.py). While a prefill chunk of C tokens runs, a sliding group briefly holds
    the chunk's blocks as well (up to about C / block_size more)."""
    full = math.ceil(num_tokens / block_size)
    return sum(full if window is None else min(full, max_sliding_blocks(window, block_size))
               for window in layout.windows)  # fmt: skip


def engine_layout(
    layer_types: tuple[str, ...], num_layers: int, window: int | None, hybrid_kv: bool,
    max_model_len: int | None = None,
) -> KVLayout:  # fmt: skip
    """The layout the engine runs: with hybrid_kv on, groups that release what left a sliding
    window when the model has sliding layers; else one group of every layer keeping every
    block. A window as long as the context (`max_model_len`) releases nothing: one full group."""
    if window is not None and max_model_len is not None and window >= max_model_len:
        window = None
    layout = plan_layout(layer_types, num_layers, window)
    if not hybrid_kv or not layout.has_sliding_groups:
        return plan_layout((), num_layers, None)
    return layout


def max_sequence_tokens(layout: KVLayout, num_blocks: int, block_size: int, chunk: int,
                        max_model_len: int) -> int:  # fmt: skip
    """The longest sequence the pool holds by itself (shorter ones could preempt themselves
    forever): besides its full-group blocks, each sliding group holds its window and the largest
    chunk a step can give it. When every layer slides, nothing grows with the context."""
    blocks = num_blocks
    for window in layout.windows:
        if window is not None:
            blocks -= -(-(window + chunk) // block_size) + 1
    if layout.windows[0] is not None:
        if blocks >= 0:
            return max_model_len
        blocks = num_blocks  # a sequence never holds more blocks than its tokens fill
    return max(1, min(max_model_len, blocks * block_size))
