"""Attention backends: the pure-torch reference (CPU, and the oracle) and Triton kernels (CUDA)."""

from __future__ import annotations

import logging

import torch

from engine_proc.attention.base import AttentionBackend, AttentionMetadata
from engine_proc.attention.torch_ref import TorchAttentionBackend

logger = logging.getLogger(__name__)

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttentionBackend", "select_backend"]


def select_backend(name: str, device: torch.device) -> AttentionBackend:
    """'auto': Triton on CUDA (when it can run there), the torch reference elsewhere;
    'torch' / 'triton' force one."""
    if name not in ("auto", "torch", "triton"):
        raise ValueError(
            f"attention_backend must be one of ('auto', 'torch', 'triton'), got {name!r}"
        )
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return TorchAttentionBackend()
    from engine_proc.attention import triton_backend as tb

    if not tb.is_triton_usable(device):
        why = (
            "TRITON_INTERPRET=1 is set (the interpreter runs on CPU tensors only)"
            if tb.kernels_interpreted()
            else "triton is missing or the GPU's compute capability is below 7.5"
        )
        if name == "auto":
            logger.warning("Triton cannot run on %s: %s; using torch attention", device, why)
            return TorchAttentionBackend()
        raise ValueError(f"attention_backend='triton' cannot run on {device}: {why}")
    return tb.TritonAttentionBackend()
