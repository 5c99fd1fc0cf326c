"""GGUF tensors dequantized to float32 torch tensors (the common llama.cpp block formats in torch,
vectorised over the whole tensor; anything else through gguf.quants). The header and tensor table
(GgufFile, read with struct, tensors as views of one mmap) live in gguf_header.py."""

from __future__ import annotations

import numpy as np
import torch

from engine_proc.loading.gguf_header import GgufFile, GgufTensor

__all__ = ["GgufFile", "GgufTensor", "dequantize"]


# ggml type ids (gguf.GGMLQuantizationType) of the formats dequantized here in torch
F32, F16, Q4_0, Q4_1, Q8_0, BF16 = 0, 1, 2, 3, 8, 30


def dequantize(tensor: GgufTensor) -> torch.Tensor:
    """float32 torch tensor in PyTorch dim order (ggml's ne0, the innermost dim, comes last)."""
    shape = tuple(reversed(tensor.shape))
    fast = _TORCH_DEQUANT.get(tensor.ggml_type)
    if fast is not None:
        raw = torch.from_numpy(np.array(tensor.data, copy=True).reshape(-1))  # off the mmap
        return fast(raw).reshape(shape).contiguous()
    import gguf
    from gguf.quants import dequantize as gguf_dequantize

    array = gguf_dequantize(tensor.data, gguf.GGMLQuantizationType(tensor.ggml_type))
    array = np.asarray(array, dtype=np.float32).reshape(shape)
    if not array.flags.writeable or not array.flags.c_contiguous:
        array = np.array(array, dtype=np.float32, order="C")  # F32 tensors are read-only mmaps
    return torch.from_numpy(array)


def _blocks(raw: torch.Tensor, block_bytes: int) -> torch.Tensor:
    return raw.reshape(-1, block_bytes)


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte offset `at` of every block, as float32 [blocks, 1]."""
    return blocks[:, at : at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """ggml's 4-bit layout: byte j holds element j (low nibble) and j + 16 (high nibble)."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=1).float()


def _q4_0(raw: torch.Tensor) -> torch.Tensor:  # 32 weights: f16 d, 16 B codes; w = (q - 8) d
    b = _blocks(raw, 18)
    return (_nibbles(b[:, 2:]) - 8.0) * _f16(b, 0)


def _q4_1(raw: torch.Tensor) -> torch.Tensor:  # f16 d, f16 m, 16 B codes; w = q d + m
    b = _blocks(raw, 20)
    return _nibbles(b[:, 4:]) * _f16(b, 0) + _f16(b, 2)


def _q8_0(raw: torch.Tensor) -> torch.Tensor:  # f16 d, 32 x int8; w = q d
    b = _blocks(raw, 34)
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b, 0)


_TORCH_DEQUANT = {
    F32: lambda raw: raw.view(torch.float32).clone(),
    F16: lambda raw: raw.view(torch.float16).float(),
    BF16: lambda raw: raw.view(torch.bfloat16).float(),
    Q4_0: _q4_0,
    Q4_1: _q4_1,
    Q8_0: _q8_0,
}
