"""The fused CPU decode step (engine_proc/fused_decode.py, engine_proc/native/fused_decode.cpp).

The quick tests check the option and the fallbacks without compiling anything. The slow ones
compile the extension once (into the suite's own cache dir) and check its 4-bit kernels
against brute-force products, its bf16 output projection against a float64 one, and greedy
decoding through it against the float64 reference of the int4 arithmetic (tests/test_int4.py),
under both bf16 arithmetics: narrow steps on our kernels are the dense model's float32
products, wide ones (and torch's kernel) bfloat16-activation products."""

from __future__ import annotations

import logging

import pytest
import torch

from engine_proc import EngineConfig, LLMEngine
from engine_proc import fused_decode as fd
from engine_proc.config import add_kernel_arguments, kernel_options
from engine_proc.models.int4 import int4_kernels_available, quantize_int4
from tests.float64_llama import bf16_round, bf16_ulp
from tests.test_int4 import (
    assert_within,
    check_greedy_decoding_against_reference,
    q4_1_matrix,
    snapped_checkpoint,
)

pytestmark = pytest.mark.skipif(
    not int4_kernels_available(), reason="this torch build has no int4 CPU kernels"
)


def _engine(decode_step: str, checkpoint=None, **config: object) -> LLMEngine:
    return LLMEngine(
        EngineConfig(num_kv_blocks=64, decode_weights="int4", decode_step=decode_step, **config),
        checkpoint=checkpoint or snapped_checkpoint(),
    )


def q8_matrix(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """int8 codes times one float16 scale per group of 32 inputs, each group holding a code of
    magnitude 127 (what a GGUF Q8_0 tensor dequantizes to)."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (out_features, in_features // 32, 32), generator=gen)
    codes[..., 0] = 127 * (1 - 2 * torch.randint(0, 2, codes.shape[:2], generator=gen))
    scale = (torch.rand(out_features, in_features // 32, 1, generator=gen) * 0.02 + 1e-3).half()
    return (codes.float() * scale.float()).view(out_features, in_features)


def q8_head_checkpoint():
    """snapped_checkpoint() with an 8-bit valued output projection."""
    ck = snapped_checkpoint()
    ck.weights["lm_head.weight"] = q8_matrix(*ck.weights["lm_head.weight"].shape, seed=7)
    return ck


def test_decode_step_is_an_engine_option_and_a_flag():
    import argparse

    with pytest.raises(ValueError, match=r"decode_step must be one of \('eager', 'fused', 'auto'"):
        EngineConfig(decode_step="compiled")
    parser = argparse.ArgumentParser()
    add_kernel_arguments(parser)
    assert kernel_options(parser.parse_args([]))["decode_step"] == "auto"
    args = parser.parse_args(["--decode-step", "eager"])
    assert kernel_options(args)["decode_step"] == "eager"


def test_eager_is_the_api_default_and_builds_nothing(monkeypatch):
    monkeypatch.setattr(fd, "load_extension", lambda: pytest.fail("nothing should be built"))
    engine = _engine("eager")
    assert EngineConfig().decode_step == "eager"
    assert engine.runner.fused.state == "eager"


def test_models_it_cannot_serve_decode_eagerly_with_the_reason_logged(monkeypatch, caplog):
    monkeypatch.setattr(fd, "load_extension", lambda: pytest.fail("nothing should be built"))
    caplog.set_level(logging.WARNING, logger="engine_proc.fused_decode")
    dense = LLMEngine(EngineConfig(num_kv_blocks=64, decode_step="fused"),
                      checkpoint=snapped_checkpoint())  # fmt: skip
    assert dense.runner.fused.state == "eager"
    assert "needs decode_weights='int4'" in caplog.text
    caplog.clear()
    int8 = _engine("fused", kv_cache_dtype="int8")
    assert int8.runner.fused.state == "eager"
    assert "needs a float32 model and KV cache" in caplog.text


def test_a_failed_build_falls_back_to_eager_with_a_warning(monkeypatch, caplog):
    def no_compiler():
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(fd, "load_extension", no_compiler)
    caplog.set_level(logging.WARNING, logger="engine_proc.fused_decode")
    engine = _engine("fused")
    assert engine.runner.fused.state == "eager"
    assert "no C++ compiler" in caplog.text and "decoding eagerly" in caplog.text
    [out] = engine.generate([list(range(5, 12))], fd_params())
    assert len(out.token_ids) == 4 and engine.runner.num_fused_steps == 0


def test_what_the_build_needs_is_named(monkeypatch):
    monkeypatch.setattr(fd.shutil, "which", lambda name: None if name == "ninja" else "/bin/x")
    assert fd.build_unavailable_reason() == "needs ninja on PATH (pip install ninja)"
    monkeypatch.setattr(fd.shutil, "which", lambda name: None)
    assert "needs a C++ compiler" in fd.build_unavailable_reason()


def test_a_killed_builds_lock_is_removed_once_stale_and_a_live_one_is_kept(tmp_path):
    assert not fd.remove_stale_lock(tmp_path)  # no lock
    lock = tmp_path / "lock"
    lock.touch()
    mtime = lock.stat().st_mtime
    assert not fd.remove_stale_lock(tmp_path, now=mtime + 60)  # a build in progress
    assert lock.exists()
    assert fd.remove_stale_lock(tmp_path, now=mtime + fd.STALE_LOCK_SECONDS + 1)
    assert not lock.exists()


def fd_params():
    from engine_proc import SamplingParams

    return SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


# ---- compiled (slow: the first build takes about a minute on 2 cores) ----------------------


@pytest.fixture(scope="module")
def extension():
    why = fd.build_unavailable_reason()
    if why is not None:  # like the CUDA tests: this machine cannot build it (the engine says so)
        pytest.skip(f"the fused decode step {why}; the engine decodes eagerly")
    return fd.load_extension()


def _kernels(module) -> list[str]:
    """Our 4-bit kernels this build has: the portable one always, the others where compiled."""
    has = {"avx512_bf16": module.has_avx512_bf16(), "avx2_fp32": module.has_avx2()}
    return ["portable", *(k for k, compiled in has.items() if compiled)]


def _products(step: fd.FusedDecodeStep, rows: int) -> str:
    """What a fused step of ``rows`` rows computes (tests/test_int4.py: DECODE_PRODUCTS)."""
    if step.int4_kernel == "torch":
        return "bf16"
    if rows <= step.precise_rows or step.int4_kernel == "avx2_fp32":  # AVX2: float32 at any width
        return "exact"
    return "bf16_in"


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
    kernels = [k for k in _kernels(extension) if k != "avx512_bf16" or pack_block == 64]
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
    inexact = planes.clone()
    inexact[0, 0, 0] = 0.1  # not a float16 value
    assert fd.kernel_planes(inexact, "avx2_fp32") is inexact


def snapped_to_float16_q4_1(weight: torch.Tensor) -> torch.Tensor:
    """The matrix as a GGUF Q4_1 tensor holds it: per group of 32, codes 0..15 times a float16
    scale d plus a float16 minimum m, in float32 (the loader's q * d + m)."""
    groups = weight.view(weight.shape[0], -1, 32)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    d, m = ((high - low) / 15).half().float(), low.half().float()
    codes = torch.round((groups - m) / d).clamp(0, 15)
    return (codes * d + m).view_as(weight)


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
def test_fused_greedy_decoding_follows_the_float64_reference(extension, native_bf16):
    engine = _engine("fused")
    assert engine.runner.fused.state == "fused"
    step = engine.runner.fused.step
    check_greedy_decoding_against_reference(engine, native_bf16, decode_products=_products(step, 3))
    # every decode step (8 - 1 per batch) ran fused; the prefills ran eagerly
    assert engine.runner.num_fused_steps == 2 * 7


@pytest.mark.slow
def test_wide_fused_steps_take_bf16_activations(extension):
    """Steps wider than precise_rows (set to 0 here: every step) run our kernels' fast
    products: bfloat16 activations, float32 outputs (AVX512-BF16); float32 products on AVX2."""
    engine = _engine("fused")
    step = engine.runner.fused.step
    assert step is not None
    step.precise_rows = 0
    native = engine.model.native_bf16
    check_greedy_decoding_against_reference(engine, native, decode_products=_products(step, 1))
    assert engine.runner.num_fused_steps == 2 * 7


@pytest.mark.slow
@pytest.mark.parametrize("chunks", [2, 5])
def test_attention_split_into_chunks_decodes_like_the_reference(extension, chunks):
    """Long contexts are attended in chunks of blocks on several threads and merged: forced here
    on short ones (5 chunks: more than some sequences have blocks, so some chunks are empty)."""
    engine = _engine("fused")
    step = fd.FusedDecodeStep.create(engine.model, extension, attention_chunks=chunks)
    engine.runner.fused.step = step
    native = engine.model.native_bf16
    check_greedy_decoding_against_reference(engine, native, decode_products=_products(step, 3))
    assert engine.runner.num_fused_steps == 2 * 7


@pytest.mark.slow
def test_a_step_wider_than_one_call_runs_as_several(extension, monkeypatch):
    """Rows are independent: a 3-row decode step as calls of 2 + 1 rows decodes like the
    reference (each call writes its rows' K/V and reads only their own blocks)."""
    monkeypatch.setattr(fd, "ROWS_PER_CALL", 2)
    engine = _engine("fused")
    step = engine.runner.fused.step
    assert step is not None
    calls: list[int] = []

    class CountingDecoder:
        def forward(self, input_ids, *args):
            calls.append(len(input_ids))
            return decoder.forward(input_ids, *args)

    decoder, step.decoder = step.decoder, CountingDecoder()
    native = engine.model.native_bf16
    check_greedy_decoding_against_reference(engine, native, decode_products=_products(step, 3))
    assert engine.runner.num_fused_steps == 2 * 7
    assert sorted(set(calls)) == [1, 2] and max(calls) == 2


@pytest.mark.slow
@pytest.mark.parametrize("kernel", fd.INT4_KERNELS)
def test_every_int4_kernel_decodes_like_the_reference(extension, kernel):
    if kernel not in ("torch", *_kernels(extension)):  # not compiled in: that CPU lacks it
        kernel = "torch"
    engine = _engine("fused")
    step = fd.FusedDecodeStep.create(engine.model, extension, kernel)
    engine.runner.fused.step = step
    native = engine.model.native_bf16
    check_greedy_decoding_against_reference(engine, native, decode_products=_products(step, 3))
    assert engine.runner.num_fused_steps == 2 * 7


@pytest.mark.slow
def test_auto_loads_a_cached_build_or_builds_in_the_background(extension, monkeypatch):
    assert fd.is_built()  # the fixture's build, in this suite's cache dir
    assert _engine("auto").runner.fused.state == "fused"
    monkeypatch.setattr(fd, "is_built", lambda: False)  # as on a first start
    engine = _engine("auto")
    assert engine.runner.fused.state == "building"
    pending = engine.runner.fused._pending
    assert pending is not None
    pending.result(timeout=600)  # the background thread finds the module already loaded
    [out] = engine.generate([list(range(5, 12))], fd_params())
    assert engine.runner.fused.state == "fused" and len(out.token_ids) == 4
    assert engine.runner.num_fused_steps == 3


@pytest.mark.slow
def test_kernels_given_no_rows_return_no_rows(extension):
    weight, _ = q4_1_matrix(192, 96, seed=0)
    packed = quantize_int4(weight)
    for kernel in _kernels(extension):
        assert _int4_mm(extension, torch.empty(0, 96), packed, kernel, True).shape == (0, 192)
    codes, scales = extension.q8_pack(q8_matrix(64, 96, seed=1))
    assert extension.q8_logits(torch.empty(0, 96), codes, scales).shape == (0, 64)


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
def test_fused_decoding_with_an_8bit_head_follows_the_float64_reference(extension):
    ck = q8_head_checkpoint()
    engine = _engine("fused", checkpoint=ck)
    assert fd.use_head_kernel(engine.model, extension) == "q8"
    assert fd.use_head_kernel(_engine("fused").model, extension) == "bf16"
    # float32 products on the exact weights: the reference's unrounded head, for every row;
    # with our kernels, float32 products everywhere (a tolerance of 2^-14)
    step = engine.runner.fused.step
    check_greedy_decoding_against_reference(
        engine, engine.model.native_bf16, ck, 0, decode_products=_products(step, 3)
    )


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


@pytest.mark.slow
def test_only_wide_fused_steps_take_their_logits_from_bf16_activations(extension):
    engine = _engine("fused", checkpoint=q8_head_checkpoint())
    step = engine.runner.fused.step
    if step.wide_head is None:
        pytest.skip("the bfloat16 8-bit head needs AVX512-BF16 (and a CPU that has it natively)")
    calls: list[int] = []
    wide_head = step.wide_head

    def counting(hidden):
        calls.append(hidden.shape[0])
        return wide_head(hidden)

    step.wide_head = counting
    prompts = [list(range(5, 12)), list(range(20, 31)), [3] * 9]
    engine.generate(prompts, fd_params())  # 3 rows a step: precise, the exact head
    assert calls == []
    step.precise_rows = 2
    engine.generate(prompts, fd_params())  # every decode step is wide now
    assert calls == [3, 3, 3]  # fd_params: 4 tokens, the first from the (eager) prefill
