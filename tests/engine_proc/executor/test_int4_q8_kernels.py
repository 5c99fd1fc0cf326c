"""The 8-bit-activation 4-bit products of wide steps (engine_proc/native/int4_q8_kernels.h):
the strips layout byte by byte from its definition, and the products against a float64
recount of the same arithmetic (activations quantized per group of 32 by numpy), the AVX2 and
AVX512-VNNI kernels bit for bit the scalar one, each row independent of the rows beside it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_proc.executor import fused_decode as fd
from engine_proc.models.int4 import int4_kernels_available, quantize_int4
from tests.engine_proc.executor import extension_builds
from tests.engine_proc.executor.test_fused_decode_kernels import (
    snapped_to_float16_q4_1,
    unpack_codes,
)
from tests.engine_proc.models.test_int4 import assert_within, q4_1_matrix

# each build: this CPU's, and Haswell's where this CPU has AVX-512 (extension_builds.py)
extension = extension_builds.extension_fixture()

pytestmark = [
    pytest.mark.skipif(
        not int4_kernels_available(), reason="this torch build has no int4 CPU kernels"
    ),
    pytest.mark.slow,
]


def _codes(weight) -> torch.Tensor:
    block = fd.torch_int4_pack_block()
    assert block is not None
    n, k = weight.out_features, weight.in_features
    return unpack_codes(weight.packed, block, n, k)


def _strips(extension, weight) -> torch.Tensor:
    block = fd.torch_int4_pack_block()
    return extension.int4_strips(weight.packed, weight.in_features, weight.out_features, block)


def test_strips_hold_16_columns_by_4_inputs_per_32_bytes(extension):
    weight = quantize_int4(q4_1_matrix(192, 96, seed=1)[0])
    codes = _codes(weight)  # [N, K]
    strips = _strips(extension, weight)
    assert strips.shape == (192 // 16, 96 // 4, 32) and strips.dtype == torch.uint8
    s = strips.int()
    for strip in (0, 5, 11):
        for quad in (0, 7, 23):
            for c in range(8):
                for t in range(4):
                    byte = int(s[strip, quad, 4 * c + t])
                    assert byte & 15 == codes[16 * strip + c, 4 * quad + t]
                    assert byte >> 4 == codes[16 * strip + 8 + c, 4 * quad + t]


def quantize_groups(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per group of 32 inputs, in float32 as the kernel: dx = max|x| / 127, codes rint(x / dx)
    (through 1 / dx, ties to even), sx = dx * sum(codes). Returns codes [rows, G, 32], dx, sx."""
    g = x.numpy().astype(np.float32).reshape(x.shape[0], -1, 32)
    dx = (np.abs(g).max(-1) / np.float32(127)).astype(np.float32)
    inv = np.where(dx != 0, np.float32(1) / np.where(dx != 0, dx, 1), 0).astype(np.float32)
    codes = np.rint((g * inv[..., None]).astype(np.float32))
    sx = (dx * codes.sum(-1).astype(np.float32)).astype(np.float32)
    return codes, dx, sx


# AVX2 passes of up to six rows, as even as they come (9 = 5 + 4, 13 = 5 + 4 + 4, 16 = 6 + 5 + 5),
# AVX512-VNNI up to eight (9 = 5 + 4, 15 = 8 + 7)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 6, 7, 8, 9, 13, 15, 16])
@pytest.mark.parametrize("half_planes", [False, True])
def test_q8_products_are_the_recounted_8bit_activation_products(extension, rows, half_planes):
    dense = snapped_to_float16_q4_1(q4_1_matrix(192, 96, seed=rows)[0])
    weight = quantize_int4(dense)
    planes = fd.kernel_planes(weight.planes, "avx2_fp32") if half_planes else weight.planes
    assert planes.dtype == (torch.float16 if half_planes else torch.float32)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)) * 3
    x[0, 32:64] = 0  # a group of zeros: no step, codes 0
    strips = _strips(extension, weight)
    got = extension.int4_mm_q8(x, strips, planes, 0)  # the scalar kernel
    assert got.dtype == torch.float32 and got.shape == (rows, 192)

    codes, dx, sx = quantize_groups(x)
    w_codes = _codes(weight).double().view(192, 3, 32)  # [N, G, 32]
    scale, low = weight.planes[:, 0].double().t(), weight.planes[:, 1].double().t()  # [N, G]
    d = torch.einsum("rgi,ngi->rng", torch.from_numpy(codes).double(), w_codes)  # exact integers
    step, xsum = torch.from_numpy(dx).double()[:, None], torch.from_numpy(sx).double()[:, None]
    scaled, lows = scale * step * d, low * xsum  # [rows, N, G]
    # float32: the scale times dx rounds once, each group's two FMAs once each (on sums of at
    # most every term so far)
    rounding = 8 * 2**-24 * (scaled.abs() + lows.abs()).sum(-1)
    assert_within(got, (scaled + lows).sum(-1), rounding)
    # and that is the product to 8-bit activations: each input within half a step dx of x
    half_steps = torch.from_numpy(dx).double().repeat_interleave(32, 1) / 2  # [rows, K]
    bound = half_steps @ dense.double().abs().t() + rounding
    assert_within(got, x.double() @ dense.double().t(), bound)

    for index, name in enumerate(fd.Q8_KERNELS):
        if extension.q8_kernel_compiled(index):
            assert torch.equal(extension.int4_mm_q8(x, strips, planes, index), got), name
        else:
            with pytest.raises(RuntimeError, match="not compiled in"):
                extension.int4_mm_q8(x, strips, planes, index)
    best = extension.best_q8_kernel()  # the fused step's
    alone = [extension.int4_mm_q8(x[i : i + 1], strips, planes, best) for i in range(rows)]
    assert torch.equal(torch.cat(alone), got)


def test_q8_products_of_no_rows_and_bad_shapes(extension):
    weight = quantize_int4(q4_1_matrix(64, 96, seed=2)[0])
    strips = _strips(extension, weight)
    assert extension.int4_mm_q8(torch.empty(0, 96), strips, weight.planes, 0).shape == (0, 64)
    with pytest.raises(RuntimeError, match="strips"):
        extension.int4_mm_q8(torch.randn(2, 96), strips[:2], weight.planes, 0)
    with pytest.raises(RuntimeError, match="planes"):
        extension.int4_mm_q8(torch.randn(2, 96), strips, weight.planes.double(), 0)
    with pytest.raises(RuntimeError, match=r"kernel must be 0 \(portable\), 1 \(avx2\) or 2"):
        extension.int4_mm_q8(torch.randn(2, 96), strips, weight.planes, 3)
