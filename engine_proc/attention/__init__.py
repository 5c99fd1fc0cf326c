"""Attention backends: the pure-torch reference (CPU, and the oracle) and Triton kernels (CUDA)."""

from __future__ import annotations

import logging

import torch

from engine_proc.attention.base import AttentionBackend, AttentionMetadata
from engine_proc.attention.kv_quant import Fp8TorchAttentionBackend, Int8TorchAttentionBackend
from engine_proc.attention.torch_ref import TorchAttentionBackend

logger = logging.getLogger(__name__)

_TORCH_BACKENDS: dict[str, type[TorchAttentionBackend]] = {
    "auto": TorchAttentionBackend,
    # a float pool of another type than the model's: reads and writes cast (torch_ref.py)
    "fp32": TorchAttentionBackend,
    "fp16": TorchAttentionBackend,
    "int8": Int8TorchAttentionBackend,
    "fp8": Fp8TorchAttentionBackend,
}

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttentionBackend", "select_backend"]


def select_backend(
    name: str, device: torch.device, kv_cache_dtype: str = "auto"
) -> AttentionBackend:
    """'auto': Triton on CUDA (when it can run there), the torch reference elsewhere;
    'torch' / 'triton' force one. Either reads and writes the pool in ``kv_cache_dtype``
    (auto | int8 | fp8; fp32 and fp16 pools under a model of another dtype on the torch backend
    only: engine_proc/attention/kv_quant.py resolve_kv_cache_dtype)."""
    if name not in ("auto", "torch", "triton"):
        raise ValueError(
            f"attention_backend must be one of ('auto', 'torch', 'triton'), got {name!r}"
        )
    if kv_cache_dtype not in _TORCH_BACKENDS:
        raise ValueError(
            f"kv_cache_dtype must be one of {tuple(_TORCH_BACKENDS)}, got {kv_cache_dtype!r}"
        )
    torch_backend = _TORCH_BACKENDS[kv_cache_dtype]
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return torch_backend()
    if kv_cache_dtype in ("fp32", "fp16"):
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} under a model of another dtype runs on the torch "
            "attention backend only; on CUDA use 'auto' (the model dtype), 'int8' or 'fp8'"
        )
    from engine_proc.attention import triton_backend as tb

    if not tb.is_triton_usable(device):
        why = (
            "TRITON_INTERPRET=1 is set (the interpreter runs on CPU tensors only)"
            if tb.kernels_interpreted()
            else "triton is missing or the GPU's compute capability is below 7.5"
        )
        if name == "auto":
            logger.warning("Triton cannot run on %s: %s; using torch attention", device, why)
            return torch_backend()
        raise ValueError(f"attention_backend='triton' cannot run on {device}: {why}")
    return tb.TritonAttentionBackend(kv_cache_dtype)
