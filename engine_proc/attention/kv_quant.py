"""Quantised KV caches on the torch attention path, and what the engine needs to set one up.

int8: symmetric int8 with one float16 scale per token and KV head, kept in a scale tensor beside
the pool (fp8, per-layer scales, is in kv_fp8.py; the Triton kernels read both formats in
triton_kv_codec.py).

The KV write quantises each (token, head) row of head_dim values: scale = max|x| / 127 rounded to
float16, q = round(x / scale). Attention dequantises only the blocks a step gathers (never the
whole pool): `QuantizedKV` stands in for one layer's K or V cache, and indexing it or
`index_select` on it returns dequantised rows in the model dtype, so the reference backend's code
runs unchanged on top of it.
"""

from __future__ import annotations

from typing import Any

import torch

from engine_proc.attention.kv_fp8 import FP8_DTYPE, Fp8KV
from engine_proc.attention.torch_ref import TorchAttentionBackend
from engine_proc.core.kv_sizing import (  # noqa: F401 - the engine and tests import them here
    FLOAT_POOL_BYTES,
    kv_bytes_per_token,
    kv_int8_bytes_per_token,
)

SCALE_DTYPE = torch.float16
_MIN_SCALE = 1e-5  # rows below 127e-5 in magnitude round to zero: far under attention noise


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (int8 values [..., head_dim], float16 scales [...])."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / 127.0).clamp(min=_MIN_SCALE).to(SCALE_DTYPE)
    q = torch.round(xf / scale.float().unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)


class QuantizedKV:
    """One layer's int8 K (or V) cache [num_blocks, block_size, num_kv_heads, head_dim] and its
    scales [num_blocks, block_size, num_kv_heads]; reads return dequantised tensors."""

    __slots__ = ("data", "scale", "dtype")

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        assert data.dtype == torch.int8 and scale.shape == data.shape[:-1]
        self.data = data
        self.scale = scale
        self.dtype = dtype

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    def __getitem__(self, index: object) -> torch.Tensor:
        return dequantize_int8(self.data[index], self.scale[index], self.dtype)

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        assert dim == 0
        return dequantize_int8(
            self.data.index_select(0, index), self.scale.index_select(0, index), self.dtype
        )

    def write(self, values: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        q, s = quantize_int8(values)
        num_kv_heads, head_dim = self.data.shape[-2:]
        self.data.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, q)
        self.scale.view(-1, num_kv_heads).index_copy_(0, slot_mapping, s)


class QuantizedTorchAttentionBackend(TorchAttentionBackend):
    """The torch reference attention over quantised layers (QuantizedKV or Fp8KV): writes go
    through the layer's quantiser, reads through its dequantising index."""

    graph_safe = False

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: QuantizedKV | Fp8KV,  # type: ignore[override]
        v_cache: QuantizedKV | Fp8KV,  # type: ignore[override]
        slot_mapping: torch.Tensor,
    ) -> None:
        valid = slot_mapping >= 0
        if not bool(valid.all()):
            slot_mapping, key, value = slot_mapping[valid], key[valid], value[valid]
        k_cache.write(key, slot_mapping)
        v_cache.write(value, slot_mapping)


class Int8TorchAttentionBackend(QuantizedTorchAttentionBackend):
    name = "torch-int8"


class Fp8TorchAttentionBackend(QuantizedTorchAttentionBackend):
    name = "torch-fp8"


# Plain float pools of another type than the model's (the torch backend casts; torch_ref.py)
FLOAT_POOLS = {"fp32": torch.float32, "fp16": torch.float16}
assert {k: v.itemsize for k, v in FLOAT_POOLS.items()} == FLOAT_POOL_BYTES


def resolve_kv_cache_dtype(
    kv_cache_dtype: str, model_dtype: torch.dtype, decode_weights: str, native_bf16: bool
) -> str:
    """The pool format an engine runs: "auto" is the model dtype, except float16 under a
    float32 model decoding on 4-bit weights on an AVX512-BF16 CPU (``native_bf16``; the int4
    mode's products are approximate anyway): llama.cpp's default KV type, half the bytes the
    wide decode steps read (Zen 5: a 64-row fused step at 100-token contexts 0.81x the time,
    at 1,000 0.57x), the parity replies as often the dense model's as with float32 K/V there
    (tests/engine_proc/models/test_int4_agreement.py: narrow 8 of 8; 16-row steps 7 and 7 of 8). Not
    on AVX2-only CPUs: the gain is smaller where the products bound the step (the AVX2 build on Zen
    5: 0.92x at 100-token contexts) and 16-row steps' replies were identical on 6 and 4 of 8
    (float32 K/V: 7 and 6), all at near-ties but below the suite's claim. A float pool of the
    model's own dtype is "auto" (one name for one cache content)."""
    if (
        kv_cache_dtype == "auto" and model_dtype == torch.float32 and decode_weights == "int4"
        and native_bf16
    ):  # fmt: skip
        return "fp16"
    if FLOAT_POOLS.get(kv_cache_dtype) == model_dtype:
        return "auto"
    return kv_cache_dtype


def pool_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element type of the pool tensor for a kv_cache_dtype."""
    return {**FLOAT_POOLS, "int8": torch.int8, "fp8": FP8_DTYPE}.get(kv_cache_dtype, model_dtype)


def layer_caches(
    kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    kv_scales: torch.Tensor | None,  # int8: [num_layers, 2, num_blocks, block_size, heads]
    layer_scales: torch.Tensor | None,  # fp8: [num_layers, 2]
    dtype: torch.dtype,  # what attention reads a quantised cache back in
) -> list[tuple[Any, Any]]:
    """Per layer, the (K, V) objects the model hands its attention backend: views of the pool,
    or QuantizedKV / Fp8KV wrappers of them."""
    layers = range(kv_cache.shape[0])
    if kv_cache.dtype == torch.int8:
        assert kv_scales is not None
        return [tuple(QuantizedKV(kv_cache[i, j], kv_scales[i, j], dtype) for j in (0, 1))
                for i in layers]  # fmt: skip
    if kv_cache.dtype == FP8_DTYPE:
        assert layer_scales is not None and layer_scales.shape == (kv_cache.shape[0], 2)
        return [tuple(Fp8KV(kv_cache[i, j], layer_scales[i, j], dtype) for j in (0, 1))
                for i in layers]  # fmt: skip
    return [(kv_cache[i, 0], kv_cache[i, 1]) for i in layers]
