"""Where and in what form the engine computes: the device asked for (checked against the
machine) and the decode weights "auto" resolves to."""

from __future__ import annotations

import logging

import torch

from engine_proc.models.config import ModelConfig
from engine_proc.models.llama import int4_unsupported_reason

# the engine's own log, as before this module was split out of llm_engine.py (what users filter)
logger = logging.getLogger("engine_proc.engine.llm_engine")


def resolve_decode_weights(choice: str, config: ModelConfig, device: torch.device) -> str:
    if choice != "auto":
        return choice
    why = int4_unsupported_reason(config, device)
    if why is not None:
        logger.info("decode weights: dense (int4 %s)", why)
        return "dense"
    return "int4"


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "device 'cuda' was asked for but no CUDA GPU is available; use 'cpu' or 'auto'"
        )
    if dev.type == "cuda":
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"device {device!r}: this machine has CUDA devices 0..{count - 1}")
        # Triton launches, CUDA graph capture and their streams all follow the *current*
        # device: make it the engine's, or cuda:1 would get kernels aimed at cuda:0.
        torch.cuda.set_device(dev)
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev
