"""The fused decode step's kernels one by one (engine_proc/native/int4_kernels.h,
head_kernels.h, tile_gemm.h), compiled once into the suite's cache (`extension`,
tests/conftest.py): the 4-bit products against brute-force float64 ones on both of torch's
packed layouts, the bf16 and 8-bit output projections against float64 ones, and that a row's
results do not depend on the rows beside it."""

from __future__ import annotations

import pytest
import torch

from engine_proc.executor import fused_decode as fd
from engine_proc.models.int4 import int4_kernels_available, quantize_int4
from tests.engine_proc.executor import extension_builds
from tests.engine_proc.models.test_int4 import assert_within, q4_1_matrix
from tests.float64_llama import bf16_round, bf16_ulp

# each build: this CPU's, and Haswell's where this CPU has AVX-512 (extension_builds.py)
extension = extension_builds.extension_fixture()

pytestmark = pytest.mark.skipif(
    not int4_kernels_available(), reason="this torch build has no int4 CPU kernels"
)


def q8_matrix(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """int8 codes times one float16 scale per group of 32 inputs, each group holding a code of
    magnitude 127 (what a GGUF Q8_0 tensor dequantizes to)."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (out_features, in_features // 32, 32), generator=gen)
    codes[..., 0] = 127 * (1 - 2 * torch.randint(0, 2, codes.shape[:2], generator=gen))
    scale = (torch.rand(out_features, in_features // 32, 1, generator=gen) * 0.02 + 1e-3).half()
    return (codes.float() * scale.float()).view(out_features, in_features)


def our_kernels(module) -> list[str]:
    """Our 4-bit kernels this build has: the portable one always, the others where compiled."""
    has = {"avx512_bf16": module.has_avx512_bf16(), "avx2_fp32": module.has_avx2()}
    return ["portable", *(k for k, compiled in has.items() if compiled)]


def pack_codes(codes: torch.Tensor, block: int) -> torch.Tensor:
    """4-bit codes [N, K] in the packed layout of ``block``-column blocks, byte by byte from its
    definition: byte (b, k, j) = code(B b + j, k) | code(B b + B / 2 + j, k) << 4."""
    n, k = codes.shape
    half = block // 2
    out = torch.empty(n // block, k, half, dtype=torch.uint8)
    for b in range(n // block):
        for j in range(half):
            out[b, :, j] = (codes[b * block + j] | codes[b * block + half + j] << 4).to(torch.uint8)
    return out.view(n, k // 2)


def unpack_codes(packed: torch.Tensor, block: int, n: int, k: int) -> torch.Tensor:
    """The inverse of pack_codes."""
    half = block // 2
    bytes_ = packed.reshape(n // block, k, half).int()
    codes = torch.empty(n, k, dtype=torch.int32)
    for b in range(n // block):
        for j in range(half):
            codes[b * block + j] = bytes_[b, :, j] & 15
            codes[b * block + half + j] = bytes_[b, :, j] >> 4
    return codes


def test_torch_packs_4bit_codes_in_a_layout_our_kernels_read():
    """Blocks of 64 columns where torch runs its AVX-512 code, 32 on AVX2 CPUs: both seen."""
    block = fd.torch_int4_pack_block()
    assert block in fd.PACK_BLOCKS
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (192, 96), generator=gen, dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    assert torch.equal(packed.flatten(), pack_codes(codes, block).flatten())
    assert torch.equal(unpack_codes(packed, block, 192, 96), codes)


def _int4_mm(extension, x, packed, kernel: str, precise: bool, pack_block: int | None = None,
             half_planes: bool = False) -> torch.Tensor:  # fmt: skip
    """Our kernel's product; with pack_block, on the weight's codes repacked in that layout;
    half_planes: the scales and lows as float16 (the weight's must all be float16 values)."""
    torch_block = fd.torch_int4_pack_block()
    assert torch_block is not None
    bytes_ = packed.packed
    if pack_block is not None and pack_block != torch_block:
        n, k = packed.planes.shape[2], packed.planes.shape[0] * 32
        bytes_ = pack_codes(unpack_codes(bytes_, torch_block, n, k), pack_block)
    planes = packed.planes
    if half_planes:
        planes = fd.kernel_planes(planes, kernel)
        assert planes.dtype == torch.float16
    return extension.int4_mm(
        x, bytes_, packed.scales_zeros, planes, fd.INT4_KERNELS.index(kernel), precise,
        pack_block or torch_block,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("pack_block", fd.PACK_BLOCKS)
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 16])  # 7: a pass of four rows, then 2 + 1
def test_our_int4_kernels_are_the_float32_or_bf16_activation_product(extension, rows, pack_block):
    """Precise: weights held exactly (a Q4_1 matrix with float16 scales and offsets, as in the
    GGUF), within float32 sums (plus 2^-18 of each activation) of the exact product. Fast: on
    weights whose scales and offsets are bfloat16 values (lossless in torch's layout too),
    within float32 sums of the product of bfloat16-rounded activations, unrounded. Both of
    torch's packed layouts, whichever this CPU's torch writes (the AVX512-BF16 kernel reads
    blocks of 64 columns only). The portable and AVX2 kernels also read the precise case's
    scales and lows as float16 (they are float16 values, as the GGUF's are): the same products."""
    weight, _ = q4_1_matrix(192, 96, seed=rows)  # lossless 4-bit weights: 3 blocks of 64
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)) * 3
    cases = [(True, snapped_to_float16_q4_1(weight), x.double(), 2**-17),
             (False, weight, bf16_round(x.double()), 0)]  # fmt: skip
    kernels = [k for k in our_kernels(extension) if k != "avx512_bf16" or pack_block == 64]
    for kernel in kernels:
        for precise, w, x64, rel in cases:
            if kernel == "avx2_fp32":  # float32 products either way
                x64, rel = x.double(), 2**-18
            packed, w64 = quantize_int4(w), w.double()
            got = _int4_mm(extension, x, packed, kernel, precise, pack_block)
            assert got.dtype == torch.float32
            magnitude = x64.abs() @ w64.abs().t()
            # float32: the folded group sums round ~3 times per group, the K / 32 group sums
            # once each; generous by ~4x
            tol = (2**-20 + rel) * magnitude
            assert_within(got, x64 @ w64.t(), tol)
            if precise and kernel in ("portable", "avx2_fp32"):
                half = _int4_mm(extension, x, packed, kernel, precise, pack_block, half_planes=True)
                assert torch.equal(half, got)
        packed = quantize_int4(cases[0][1])
        # a row's products do not depend on the rows beside it; the AVX2 kernel's paths (one or
        # two rows in registers, folded per group; three or more through tiles) each keep that,
        # and agree with each other to float32 rounding (the reference check above)
        alone = [
            _int4_mm(extension, x[i : i + 1], packed, kernel, True, pack_block) for i in range(rows)
        ]
        together = _int4_mm(extension, x, packed, kernel, True, pack_block)
        if kernel != "avx2_fp32" or rows < 3:
            assert torch.equal(torch.cat(alone), together)
        else:
            pairs = [_int4_mm(extension, x[i : i + 2], packed, kernel, True, pack_block)
                     for i in range(0, rows - 1, 2)]  # fmt: skip
            assert torch.equal(torch.cat(pairs), torch.cat(alone)[: len(pairs) * 2])
            threes = [_int4_mm(extension, x[i : i + 3], packed, kernel, True, pack_block)
                      for i in range(0, rows - 2, 3)]  # fmt: skip
            assert torch.equal(torch.cat(threes), together[: len(threes) * 3])


def test_planes_are_float16_only_where_every_value_is_one():
    planes = torch.tensor([[[0.5, 0.25], [-1.0, 2.0**-10]]])
    assert fd.kernel_planes(planes, "avx2_fp32").dtype == torch.float16
    assert fd.kernel_planes(planes, "portable").dtype == torch.float16
    # the AVX512-BF16 kernel (and torch's) read float32 planes
    assert fd.kernel_planes(planes, "avx512_bf16") is planes
    assert fd.kernel_planes(planes, "torch") is planes
    # ... unless every product of the weight runs on 8-bit activations (those kernels read both)
    assert fd.kernel_planes(planes, "avx512_bf16", only_q8=True).dtype == torch.float16
    inexact = planes.clone()
    inexact[0, 0, 0] = 0.1  # not a float16 value
    assert fd.kernel_planes(inexact, "avx2_fp32") is inexact
    assert fd.kernel_planes(inexact, "avx512_bf16", only_q8=True) is inexact


def snapped_to_float16_q4_1(weight: torch.Tensor) -> torch.Tensor:
    """The matrix as a GGUF Q4_1 tensor holds it: per group of 32, codes 0..15 times a float16
    scale d plus a float16 minimum m, in float32 (the loader's q * d + m)."""
    groups = weight.view(weight.shape[0], -1, 32)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    d, m = ((high - low) / 15).half().float(), low.half().float()
    codes = torch.round((groups - m) / d).clamp(0, 15)
    return (codes * d + m).view_as(weight)


@pytest.mark.slow
def test_kernels_given_no_rows_return_no_rows(extension):
    weight, _ = q4_1_matrix(192, 96, seed=0)
    packed = quantize_int4(weight)
    for kernel in our_kernels(extension):
        assert _int4_mm(extension, torch.empty(0, 96), packed, kernel, True).shape == (0, 192)
    codes, scales = extension.q8_pack(q8_matrix(64, 96, seed=1))
    assert extension.q8_logits(torch.empty(0, 96), codes, scales).shape == (0, 64)


@pytest.mark.slow
@pytest.mark.parametrize("native", [False, True])
def test_the_bf16_head_is_the_rounded_float64_product(extension, native):
    gen = torch.Generator().manual_seed(2)
    head = torch.randn(320, 64, generator=gen).bfloat16()
    hidden = torch.randn(5, 64, generator=gen)
    got = extension.bf16_logits(hidden, head, native).double()
    x64, w64 = bf16_round(hidden.double()), head.double()
    exact = x64 @ w64.t()
    assert torch.equal(got, bf16_round(got))  # bfloat16 values
    # float32 sums of exact products: at most one bf16 step from the rounded exact sum
    tol = bf16_ulp(exact) + 66 * 2**-24 * (x64.abs() @ w64.abs().t())
    assert_within(got, bf16_round(exact), tol)


@pytest.mark.slow
def test_an_8bit_valued_head_is_held_exactly_and_multiplied_in_float32(extension):
    weight = q8_matrix(64, 96, seed=1)
    codes, scales = extension.q8_pack(weight)
    assert codes.dtype == torch.int8 and scales.dtype == torch.float32
    # the layout, [N / 16, K, 16] codes and [N / 16, K / 32, 16] scales, gives the weight back
    back = codes.float() * scales.repeat_interleave(32, dim=1)
    assert torch.equal(back.transpose(1, 2).reshape(64, 96), weight)
    assert extension.q8_pack(bf16_round(torch.randn(64, 96))) == []  # not 8-bit: not used
    hidden = torch.randn(7, 96, generator=torch.Generator().manual_seed(3))
    got = extension.q8_logits(hidden, codes, scales).double()
    exact = hidden.double() @ weight.double().t()
    tol = 98 * 2**-24 * (hidden.double().abs() @ weight.double().abs().t())
    assert_within(got, exact, tol)
    # a row's logits do not depend on the rows beside it: four rows at a time, then one by one,
    # in one summation order; on AVX2 one or two rows in registers (folded per group, within
    # the tolerance above) and three or more through tiles each keep it
    alone = torch.cat([extension.q8_logits(hidden[i : i + 1], codes, scales) for i in range(7)])
    assert_within(alone.double(), exact, tol)
    pairs = torch.cat([extension.q8_logits(hidden[i : i + 2], codes, scales) for i in (0, 2, 4)])
    assert torch.equal(pairs, alone[:6])
    threes = torch.cat([extension.q8_logits(hidden[i : i + 3], codes, scales) for i in (0, 3)])
    assert torch.equal(threes.double(), got[:6])
    if not extension.has_avx2():
        assert torch.equal(alone.double(), got)


@pytest.mark.slow
def test_the_wide_8bit_head_is_the_bf16_activation_product(extension):
    if not extension.q8_bf16_available():
        pytest.skip("the bfloat16 8-bit head needs AVX512-BF16")
    weight = q8_matrix(96, 128, seed=4)
    codes, scales = extension.q8_pack(weight)
    hidden = torch.randn(13, 128, generator=torch.Generator().manual_seed(5))  # 6 + 6 + 1 rows
    got = extension.q8_bf16_logits(hidden, codes, scales).double()
    x64, w64 = bf16_round(hidden.double()), weight.double()
    # float32 sums of exact products (bf16 x, exact 8-bit codes), then times the group scales
    assert_within(got, x64 @ w64.t(), 2**-19 * (x64.abs() @ w64.abs().t()))
    alone = [extension.q8_bf16_logits(hidden[i : i + 1], codes, scales) for i in range(13)]
    assert torch.equal(torch.cat(alone).double(), got)
