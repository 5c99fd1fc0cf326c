"""Brute-force float64 references for the quantised KV formats, written from their definitions
and sharing no code with engine_proc (nor torch's float8 casts):

- e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal
  (2**-6 * m / 8); 0x7f / 0xff are NaN; no infinities; largest finite 448.
- int8: scale = max|x| / 127 (at least 1e-5) rounded to float16, codes round(x / scale) to
  nearest even, within [-127, 127].
"""

from __future__ import annotations

import math

import torch

E4M3_MAX = 448.0


def e4m3_value(code: int) -> float:
    """The float64 value of one e4m3fn code (NaN for 0x7f / 0xff)."""
    sign = -1.0 if code & 0x80 else 1.0
    e, m = (code >> 3) & 0xF, code & 0x7
    if e == 0xF and m == 0x7:
        return math.nan
    if e == 0:
        return sign * 2.0**-6 * m / 8
    return sign * 2.0 ** (e - 7) * (1 + m / 8)


E4M3_VALUES = torch.tensor([e4m3_value(c) for c in range(256)], dtype=torch.float64)


def e4m3_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes (any shape) -> float64 values."""
    return E4M3_VALUES[codes.long()]


def e4m3_round(x: torch.Tensor) -> torch.Tensor:
    """x (float64) saturated to [-448, 448] and rounded to the nearest e4m3 value, ties to the
    even code (even mantissa), as codes (uint8)."""
    finite = [c for c in range(128) if not math.isnan(e4m3_value(c))]  # non-negative codes
    grid = torch.tensor([e4m3_value(c) for c in finite], dtype=torch.float64)
    a = x.abs().clamp(max=E4M3_MAX).reshape(-1)
    dist = (a[:, None] - grid[None, :]).abs()
    best = dist.min(dim=1, keepdim=True).values
    tied = dist == best  # one or two nearest codes
    even = torch.tensor([c % 2 == 0 for c in finite])
    pick = torch.where(tied.sum(1) > 1, (tied & even).int().argmax(1), tied.int().argmax(1))
    codes = torch.tensor(finite)[pick] | torch.where(x.reshape(-1) < 0, 0x80, 0)
    return codes.to(torch.uint8).reshape(x.shape)


def fp8_round_trip(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What an fp8 pool with this scale stores of x, read back in float64."""
    return e4m3_decode(e4m3_round(x.double() / scale)) * scale


def int8_round_trip(x: torch.Tensor) -> torch.Tensor:
    """What an int8 pool stores of x [..., head_dim], read back in float64."""
    x = x.double()
    scale = (x.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-5).half().double()
    return torch.round(x / scale).clamp(-127, 127) * scale
