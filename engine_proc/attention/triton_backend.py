"""GPU attention backend: two Triton kernels over the paged KV cache.

- ``write_kv`` scatters this step's K/V rows into their slots (slot -1: write nothing), quantising
  them on the way for an int8 or fp8 pool (triton_kv_codec.py).
- ``forward`` is ONE launch for a whole mixed batch: decode tokens, prompt chunks whose earlier
  context is already cached, and fresh prompts (triton_attention_kernel.py), reading a quantised
  pool tile by tile and dequantising in registers.

One backend instance serves one pool format, ``kv_cache_dtype``: "auto" layers are plain tensors
in the model dtype, "int8" layers ``kv_quant.QuantizedKV``, "fp8" layers ``kv_fp8.Fp8KV``.
Launch constants and checks: triton_launch.py.

The module imports without triton (CPU-only installs): the kernels are then simply not defined,
``is_triton_usable`` answers False and constructing the backend raises a clear error.

Tests run the same kernels through Triton's interpreter on CPU: set ``TRITON_INTERPRET=1`` before
this module is imported (Triton decides compiled vs interpreted when a kernel is decorated).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from engine_proc.attention import triton_attention_kernel as _kernels
from engine_proc.attention import triton_kv_codec as _codec
from engine_proc.attention.base import AttentionMetadata
from engine_proc.attention.triton_kv_codec import KV_FORMATS, TRITON_IMPORT_ERROR, triton
from engine_proc.attention.triton_launch import (
    SUPPORTED_DTYPES,
    attention_constants,
    check_cache,
    check_same_device,
    kv_operands,
    launch_plan,
    scale_strides,
    write_kv_constants,
)

logger = logging.getLogger(__name__)

__all__ = [
    "TritonAttentionBackend",
    "attention_constants",
    "is_triton_usable",
    "kernels_interpreted",
    "write_kv_constants",
]


def is_triton_usable(device: torch.device | str) -> bool:
    """True when this backend can run on ``device``.

    Compiled kernels need a CUDA device Triton supports (compute capability 7.5+); interpreted
    kernels (``TRITON_INTERPRET=1`` at import) run on CPU tensors only.
    """
    if triton is None:
        return False
    dev = torch.device(device)
    if _kernels.INTERPRETED:
        return dev.type == "cpu"
    if dev.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(dev) >= (7, 5)


def kernels_interpreted() -> bool:
    """True when the kernels run through Triton's interpreter (set at import time)."""
    return _kernels.INTERPRETED


class TritonAttentionBackend:
    """Paged attention on the GPU through Triton (see the module docstring)."""

    # Launch grids and constants depend only on tensor shapes and max_query_len, and every
    # per-sequence value (and every scale) is read on the device: a decode step can be captured
    # in a CUDA graph.
    graph_safe = True

    def __init__(self, kv_cache_dtype: str = "auto") -> None:
        if triton is None:
            raise RuntimeError(
                "the triton attention backend needs the 'triton' package, which failed to import "
                f"({TRITON_IMPORT_ERROR!r}); install it (pip install triton) or set "
                "attention_backend='torch'"
            )
        if kv_cache_dtype not in KV_FORMATS:
            raise ValueError(
                f"kv_cache_dtype must be one of {tuple(KV_FORMATS)}, got {kv_cache_dtype!r}"
            )
        self.kv_cache_dtype = kv_cache_dtype
        self.name = "triton" if kv_cache_dtype == "auto" else f"triton-{kv_cache_dtype}"

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: Any,  # torch.Tensor, QuantizedKV or Fp8KV, per kv_cache_dtype
        v_cache: Any,
        slot_mapping: torch.Tensor,
    ) -> None:
        if key.dim() != 3 or value.shape != key.shape:
            raise ValueError(
                "key and value must both be [num_tokens, num_kv_heads, head_dim], "
                f"got {tuple(key.shape)} and {tuple(value.shape)}"
            )
        num_tokens, num_kv_heads, head_dim = key.shape
        k = kv_operands("k_cache", k_cache, self.kv_cache_dtype)
        v = kv_operands("v_cache", v_cache, self.kv_cache_dtype)
        check_cache("k_cache", k.data, num_kv_heads, head_dim)
        check_cache("v_cache", v.data, num_kv_heads, head_dim)
        if k.data.shape != v.data.shape:
            raise ValueError(
                f"k_cache and v_cache shapes differ: {tuple(k.data.shape)} vs {tuple(v.data.shape)}"
            )
        if slot_mapping.dim() != 1 or slot_mapping.shape[0] != num_tokens:
            raise ValueError(
                f"slot_mapping must be [num_tokens={num_tokens}], got {tuple(slot_mapping.shape)}"
            )
        check_same_device(
            key=key, value=value, k_cache=k.data, v_cache=v.data, k_scale=k.scale,
            v_scale=v.scale, slot_mapping=slot_mapping,
        )  # fmt: skip
        if num_tokens == 0:
            return
        # The kernel adds head_dim offsets directly, so the innermost dim must be dense; a
        # strided token/head layout (a slice of a fused qkv output) is fine.
        if key.stride(2) != 1:
            key = key.contiguous()
        if value.stride(2) != 1:
            value = value.contiguous()
        slot_mapping = slot_mapping.contiguous()
        _codec.write_kv_kernel[(num_tokens,)](
            key, value, k.data, v.data, k.scale, v.scale, slot_mapping,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            *k.data.stride()[:3], *v.data.stride()[:3],
            *scale_strides(k, v, self.kv_cache_dtype),
            **write_kv_constants(num_kv_heads, head_dim, k.data.shape[1], self.kv_cache_dtype),
        )  # fmt: skip

    def forward(
        self,
        query: torch.Tensor,
        k_cache: Any,  # torch.Tensor, QuantizedKV or Fp8KV, per kv_cache_dtype
        v_cache: Any,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        if window is not None and (isinstance(window, bool) or window < 1):
            raise ValueError(f"window must be a positive number of tokens, got {window!r}")
        if softcap is not None and not softcap > 0:
            raise ValueError(f"softcap must be positive, got {softcap!r}")
        if query.dim() != 3:
            raise ValueError(
                f"query must be [num_tokens, num_heads, head_dim], got {tuple(query.shape)}"
            )
        if query.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"query dtype must be one of {SUPPORTED_DTYPES}, got {query.dtype}")
        num_tokens, num_heads, head_dim = query.shape
        k = kv_operands("k_cache", k_cache, self.kv_cache_dtype)
        v = kv_operands("v_cache", v_cache, self.kv_cache_dtype)
        num_kv_heads = k.data.shape[2] if k.data.dim() == 4 else -1
        check_cache("k_cache", k.data, num_kv_heads, head_dim)
        check_cache("v_cache", v.data, num_kv_heads, head_dim)
        if self.kv_cache_dtype == "auto" and (
            k.data.dtype != query.dtype or v.data.dtype != query.dtype
        ):
            raise ValueError(
                f"k_cache/v_cache dtype ({k.data.dtype}/{v.data.dtype}) must equal the query "
                f"dtype {query.dtype}"
            )
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        check_same_device(
            query=query, k_cache=k.data, v_cache=v.data, k_scale=k.scale, v_scale=v.scale
        )
        num_seqs = meta.num_seqs
        # Every layer of a step launches with the same metadata, constants and grid: check and
        # derive them at the first layer, reuse them for the others.
        key = (query.dtype, query.device, num_tokens, num_heads, num_kv_heads, head_dim,
               k.data.shape[1])  # fmt: skip
        plan = meta.backend_plan.get(self.name)
        if plan is None or plan[0] != key:
            plan = meta.backend_plan[self.name] = (
                key, *launch_plan(query, k.data, meta, self.kv_cache_dtype),
            )  # fmt: skip
        _, consts, grid, block_tables = plan

        # Tokens past query_start_loc[-1] (batch padding) belong to no sequence and are left
        # unwritten, like the torch backend leaves them irrelevant.
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
        if num_tokens == 0 or num_seqs == 0:
            return out
        if query.stride(2) != 1:
            query = query.contiguous()
        _kernels.paged_attention_kernel[grid](
            out, query, k.data, v.data, k.scale, v.scale, block_tables, meta.seq_lens,
            meta.query_start_loc, float(scale) * math.log2(math.e), float(softcap or 0.0),
            int(window or 0), num_seqs,
            block_tables.shape[1], query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            block_tables.stride(0), *k.data.stride()[:3], *v.data.stride()[:3],
            *scale_strides(k, v, self.kv_cache_dtype),
            **consts,
        )  # fmt: skip
        return out
