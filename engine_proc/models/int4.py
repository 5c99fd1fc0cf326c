"""4-bit weights for decode-sized products on the CPU.

A decode step of a small model is one matrix-vector product per weight matrix: it reads every
weight once and does almost no arithmetic, so its time is weight bytes over memory bandwidth.
Holding the weights in 4 bits (groups of 32 along the input dimension, an asymmetric scale and
offset per group, as GGUF's Q4_1) reads 1/8 of the float32 bytes. torch ships the kernel
(``_weight_int4pack_mm_for_cpu``: bfloat16 activations, in-register dequantization).

The default model's linear layers are stored as Q4_1 in its GGUF; min/max re-quantization of
their dequantized values recovers the same 4-bit codes (the group's extremes are codes 0 and 15)
and, in float32, the same scale and offset: the fused decode step's kernels read those
(``planes``) and so hold the weights exactly. torch's kernel reads them rounded to bfloat16
(values move by up to ~0.1 of a quantization step). The kernel is slower than a float32 GEMM
once a product has more than a few rows, so products with more than ``MAX_ROWS`` rows in a
step (long prompt chunks, large decode batches) use the dense weights, which stay loaded beside
the packed ones (+1/8 of the float32 weight memory, +1/16 for the float32 planes, plus the
model's bf16 output-projection copy).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP_SIZE = 32
MAX_ROWS = 16  # measured on a 2-core AVX2 CPU: int4 wins 2-7x up to 8 rows, ties at ~16-32
_LEVELS = 15


def int4_kernels_available() -> bool:
    ops = torch.ops.aten
    return hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(
        ops, "_convert_weight_to_int4pack_for_cpu"
    )


@dataclass(slots=True)
class Int4Weight:
    packed: torch.Tensor  # torch's packed layout of the [out, in] 4-bit codes
    scales_zeros: torch.Tensor  # [in / GROUP_SIZE, out, 2] bfloat16: w = (code - 8) * s + z
    planes: torch.Tensor  # [in / GROUP_SIZE, 2, out] float32 (scale, low): w = code * s + low
    out_features: int
    in_features: int


def quantize_int4(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> Int4Weight:
    """Min/max asymmetric 4-bit quantization of an [out, in] matrix, groups along ``in``."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [out, in], got shape {tuple(weight.shape)}")
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ValueError(
            f"int4 weights need in_features divisible by {group_size}, got {in_features}"
        )
    groups = weight.detach().float().cpu().view(out_features, in_features // group_size, -1)
    low = groups.amin(dim=-1)
    high = groups.amax(dim=-1)
    scale = ((high - low) / _LEVELS).clamp_min(1e-12)
    codes = torch.round((groups - low[..., None]) / scale[..., None]).clamp_(0, _LEVELS)
    codes = codes.view(out_features, in_features).to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    planes = torch.stack([scale.t(), low.t()], dim=1).contiguous()
    # torch's kernel: w = (code - 8) * s + z with s and z in bfloat16, z against the rounded s
    # (so code 0 stays within one bf16 rounding of low, not 8 of the scale's).
    scale_bf16 = scale.bfloat16()
    zero_bf16 = (low + 8 * scale_bf16.float()).bfloat16()
    scales_zeros = torch.stack([scale_bf16.t(), zero_bf16.t()], dim=-1).contiguous()
    return Int4Weight(packed, scales_zeros, planes, out_features, in_features)


def int4_matmul(x: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
    """x [rows, in] @ weight.T -> [rows, out] in x's dtype (computed from bfloat16 inputs)."""
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x.to(torch.bfloat16).contiguous(), weight.packed, GROUP_SIZE, weight.scales_zeros
    )
    return out.to(x.dtype)
