"""int8 KV cache for the torch attention path: symmetric int8 with one float16 scale per token
and KV head, kept in a scale tensor beside the pool.

The KV write quantises each (token, head) row of head_dim values: scale = max|x| / 127 rounded to
float16, q = round(x / scale). Attention dequantises only the blocks a step gathers (never the
whole pool): `QuantizedKV` stands in for one layer's K or V cache, and indexing it or
`index_select` on it returns dequantised rows in the model dtype, so the reference backend's code
runs unchanged on top of it.
"""

from __future__ import annotations

import torch

from engine_proc.attention.torch_ref import TorchAttentionBackend

SCALE_DTYPE = torch.float16
_MIN_SCALE = 1e-5  # rows below 127e-5 in magnitude round to zero: far under attention noise


def kv_int8_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int) -> int:
    """K and V of one token: int8 values plus a float16 scale per layer and KV head."""
    return 2 * num_layers * num_kv_heads * (head_dim + SCALE_DTYPE.itemsize)


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


class Int8TorchAttentionBackend(TorchAttentionBackend):
    """The torch reference attention over an int8 KV cache (QuantizedKV layers)."""

    name = "torch-int8"
    graph_safe = False

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: QuantizedKV,  # type: ignore[override]
        v_cache: QuantizedKV,  # type: ignore[override]
        slot_mapping: torch.Tensor,
    ) -> None:
        valid = slot_mapping >= 0
        if not bool(valid.all()):
            slot_mapping, key, value = slot_mapping[valid], key[valid], value[valid]
        k_cache.write(key, slot_mapping)
        v_cache.write(value, slot_mapping)
