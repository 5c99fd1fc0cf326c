"""Attention backends: the pure-torch reference (CPU, and the oracle) and Triton kernels (CUDA)."""

from __future__ import annotations

import logging

import torch

from engine_proc.attention.base import AttentionBackend, AttentionMetadata
from engine_proc.attention.torch_ref import TorchAttentionBackend

logger = logging.getLogger(__name__)

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttentionBackend", "select_backend"]


def select_backend(name: str, device: torch.device) -> AttentionBackend:
    """'auto': Triton on CUDA, the torch reference elsewhere; 'torch' / 'triton' force one."""
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return TorchAttentionBackend()
    if name in ("auto", "triton"):
        from engine_proc.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"attention_backend must be one of ('auto', 'torch', 'triton'), got {name!r}")
