"""The output projection of fused decode steps (engine_proc/executor/fused_decode.py): which of the
extension's head kernels computes the logits of narrow and of wide steps
(engine_proc/native/head_kernels.h, head_q8_kernels.h)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import ModuleType
from typing import Protocol

import torch

from engine_proc.models.llama import LlamaModel

logger = logging.getLogger(__name__)

Q8_HEAD_ROWS = 256  # logits of up to this many rows by the 8-bit head kernel
# a step whose products all take 8-bit activations (fused_decode.Q8_PRODUCTS) gets 8-bit ones in
# its head too
ALL_PRODUCTS = ("qkv", "o", "gate_up", "down")

Head = Callable[[torch.Tensor], torch.Tensor]


class WideHeadStep(Protocol):
    """What the head wiring reads and sets on a fused step (fused_decode.FusedDecodeStep)."""

    q8_products: tuple[str, ...]
    q8_kernel: str
    wide_head: Head | None
    wide_head_kind: str
    int8_activations: bool


def use_head_kernel(
    model: LlamaModel, module: ModuleType, step: WideHeadStep | None = None
) -> str:
    """Route decode-sized logits through the extension: the exact 8-bit weights in float32
    where the output projection is 8-bit valued (a GGUF Q8_0 tensor: the default model), else
    its bf16 kernel for the int4 mode's bf16 copy. Returns which ("q8", "bf16" or "none").
    With the 8-bit one, ``step``'s wide steps get their logits as precise as their products:
    8-bit activations where they take all four products on them (AVX512-VNNI: llama.cpp's
    Q8_0 x Q8_0, 1.7x the bfloat16 kernel at 64 rows), else bfloat16 activations where the CPU
    has AVX512-BF16 (1.8x the float32 kernel at 64 rows)."""
    q8 = module.q8_pack(model.lm_head) if model.lm_head.dtype == torch.float32 else []
    if q8:
        codes, scales = q8
        model.head_kernel = lambda hidden: module.q8_logits(hidden, codes, scales)
        # float32 products either way; measured 1.6x faster than the dense product at 64 rows
        model.head_kernel_rows = Q8_HEAD_ROWS
        if step is not None:
            step.wide_head_kind, step.wide_head = _wide_head(model, module, step, codes, scales)
        kind = "q8"
        if step is not None and step.int8_activations and step.wide_head is None:
            step.wide_head_kind, step.wide_head = "q8_float", model.head_kernel
    elif model.lm_head_decode is not None:
        weight, native = model.lm_head_decode, model.native_bf16
        model.head_kernel = lambda hidden: module.bf16_logits(hidden, weight, native)
        model.head_kernel_rows = model.lm_head_decode_rows
        kind = "bf16"
        if step is not None and step.int8_activations:
            # every row through the one kernel (above lm_head_decode_rows compute_logits takes
            # the dense head), so a verified row's logits are its decode step's
            step.wide_head_kind, step.wide_head = "bf16", model.head_kernel
    else:
        return "none"
    logger.info("fused decode step: output projection by the %s kernel", kind)
    return kind


def _wide_head(
    model: LlamaModel, module: ModuleType, step: WideHeadStep, codes: torch.Tensor,
    scales: torch.Tensor,
) -> tuple[str, Head | None]:  # fmt: skip
    """Which kernel computes the logits of ``step``'s wide steps from the 8-bit head (q8_pack's
    codes and scales), and the function: ("q8", 8-bit activations), ("bf16", ...) or
    ("none", None)."""
    pairs = len(codes) % 2 == 0  # both kernels take the 16-output blocks in pairs
    all_q8 = set(step.q8_products) == set(ALL_PRODUCTS)
    if all_q8 and step.q8_kernel != "portable" and module.q8_head_vector_available() and pairs:
        offset_codes = module.q8_vnni_pack(codes)
        return "q8", lambda hidden: module.q8_q8_logits(hidden, offset_codes, scales, True)
    if model.native_bf16 and module.q8_bf16_available() and pairs:
        return "bf16", lambda hidden: module.q8_bf16_logits(hidden, codes, scales)
    return "none", None
