"""The 8-bit output projection with 8-bit activations (engine_proc/native/head_q8_kernels.h):
the offset codes byte by byte from their definition, the logits against a float64 recount of
the same arithmetic (activations quantized per group of 32 by numpy) and within half a step of
the dense product, the vector kernels (VNNI, AVX2) bit for bit their scalar twin, each row
independent."""

from __future__ import annotations

import pytest
import torch

from tests.engine_proc.executor import extension_builds
from tests.engine_proc.executor.test_fused_decode_kernels import q8_matrix
from tests.engine_proc.executor.test_int4_q8_kernels import quantize_groups
from tests.engine_proc.models.test_int4 import assert_within

# each build: this CPU's, and Haswell's where this CPU has AVX-512 (extension_builds.py)
extension = extension_builds.extension_fixture()

pytestmark = pytest.mark.slow


def test_codes_are_offset_by_128_in_lanes_of_four(extension):
    weight = q8_matrix(64, 96, seed=2)
    codes, _ = extension.q8_pack(weight)  # [N / 16, K, 16] int8
    offset = extension.q8_vnni_pack(codes)
    assert offset.shape == (4, 96 // 4, 16, 4) and offset.dtype == torch.uint8
    for block in range(4):
        for k in (0, 1, 5, 42, 95):
            for o in (0, 7, 15):
                assert int(offset[block, k // 4, o, k % 4]) == int(codes[block, k, o]) + 128


@pytest.mark.parametrize("rows", [1, 2, 3, 6, 7, 13, 14])  # sixes, threes, then the last 1 or 2
def test_logits_are_the_recounted_8bit_activation_products(extension, rows):
    weight = q8_matrix(96, 128, seed=rows)
    codes, scales = extension.q8_pack(weight)
    offset = extension.q8_vnni_pack(codes)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)) * 2
    x[0, 64:96] = 0  # a group of zeros: no step, codes 0
    got = extension.q8_q8_logits(x, offset, scales, False)  # the scalar twin
    assert got.dtype == torch.float32 and got.shape == (rows, 96)

    x_codes, dx, _ = quantize_groups(x)  # [rows, G, 32], [rows, G]
    w_codes = (weight.view(96, 4, 32) / scales.transpose(1, 2).reshape(96, 4, 1)).double()
    assert torch.equal(w_codes, w_codes.round()) and w_codes.abs().max() <= 127
    d = torch.einsum("rgi,ngi->rng", torch.from_numpy(x_codes).double(), w_codes)  # integers
    step = torch.from_numpy(dx).double()[:, None]  # [rows, 1, G]
    w_scale = scales.transpose(1, 2).reshape(96, 4).double()  # [N, G]
    terms = w_scale * step * d
    # float32: the two scales' product rounds once, each group's FMA once
    rounding = 6 * 2**-24 * terms.abs().sum(-1)
    assert_within(got, terms.sum(-1), rounding)
    # the product to 8-bit activations: each input within half a step of x
    half_steps = torch.from_numpy(dx).double().repeat_interleave(32, 1) / 2  # [rows, K]
    bound = half_steps @ weight.double().abs().t() + rounding
    assert_within(got, x.double() @ weight.double().t(), bound)

    # the vector kernel (VNNI where compiled in, else AVX2's sign trick)
    if extension.q8_head_vector_available():
        assert torch.equal(extension.q8_q8_logits(x, offset, scales, True), got)
        alone = [extension.q8_q8_logits(x[i : i + 1], offset, scales, True) for i in range(rows)]
        assert torch.equal(torch.cat(alone), got)
    else:
        with pytest.raises(RuntimeError, match="no vector kernel compiled in"):
            extension.q8_q8_logits(x, offset, scales, True)


def test_no_rows_and_bad_shapes(extension):
    codes, scales = extension.q8_pack(q8_matrix(32, 64, seed=3))
    offset = extension.q8_vnni_pack(codes)
    assert extension.q8_q8_logits(torch.empty(0, 64), offset, scales, False).shape == (0, 32)
    with pytest.raises(RuntimeError, match="q8_vnni_pack"):
        extension.q8_q8_logits(torch.randn(2, 64), codes, scales, False)
    with pytest.raises(RuntimeError, match="scales"):
        extension.q8_q8_logits(torch.randn(2, 64), offset, scales[:, :1], False)
