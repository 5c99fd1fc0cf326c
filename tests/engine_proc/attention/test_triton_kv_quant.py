"""The Triton kernels over int8 and fp8 pools (triton_kv_codec.py, triton_attention_kernel.py)
against float64 brute force, run through Triton's interpreter on CPU (tiny shapes: it is slow):

- the e4m3 encoder and decoder against every code and every tie (kv_references.py),
- the KV-write kernel's codes and scales against the formats' definitions,
- paged attention over quantised K/V against float64 attention over the stored values read back
  by the reference's own decoding; slots a kernel must not read hold NaN (fp8 NaN codes, int8
  NaN scales),
- an engine on the tiny model with the Triton backend against a float64 forward of the same
  quantisation.
"""

from __future__ import annotations

import pytest
import torch

from engine_proc import EngineConfig, LLMEngine
from engine_proc.attention.kv_fp8 import FP8_DTYPE, Fp8KV, quantize_fp8, scale_for
from engine_proc.attention.kv_quant import QuantizedKV, quantize_int8
from engine_proc.attention.triton_backend import TritonAttentionBackend
from engine_proc.executor.cuda_graphs import EagerReplayGraph
from tests.engine_proc.attention import test_kv_fp8 as fp8_engine_tests
from tests.engine_proc.attention.kv_references import e4m3_decode, e4m3_round, int8_round_trip
from tests.engine_proc.attention.test_triton_backend import (
    MIXED,
    TOLERANCES,
    make_batch,
    reference_attention,
)
from tests.needs import interpreted_triton, require_triton, triton_device

triton = require_triton()  # a failure on Linux without it (a declared test dependency)
DEVICE = torch.device(triton_device())
tl = triton.language

from engine_proc.attention.triton_kv_codec import fp8_encode, fp8_to_half  # noqa: E402


def quantised_layers(k_cache: torch.Tensor, v_cache: torch.Tensor, kv: str, dtype: torch.dtype):
    """make_batch's float caches (NaN in every slot no sequence uses) as int8 or fp8 layers, and
    float64 caches of what those store, read back by the reference's decoding."""
    layers, stored = [], []
    for cache in (k_cache, v_cache):
        x = cache.float().cpu()
        if kv == "int8":
            codes, scale = quantize_int8(x)  # NaN rows: NaN scales
            layers.append(QuantizedKV(codes.to(DEVICE), scale.to(DEVICE), dtype))
            stored.append(codes.double() * scale.double()[..., None])
        else:
            s = scale_for(x.nan_to_num().abs().max().item())
            codes = quantize_fp8(x, s)  # NaN slots: NaN codes
            layers.append(Fp8KV(codes.to(DEVICE), torch.tensor(s, device=DEVICE), dtype))
            stored.append(e4m3_decode(codes.view(torch.uint8)) * s)
    return layers, stored


def check_quantised(spec, kv, dtype, *, block_size=16, group=3, head_dim=64, num_kv_heads=2):
    query, k_cache, v_cache, meta = make_batch(
        spec, block_size=block_size, num_heads=num_kv_heads * group, num_kv_heads=num_kv_heads,
        head_dim=head_dim, dtype=torch.float32,
    )  # fmt: skip
    query = query.to(dtype)
    (k_layer, v_layer), (k_ref, v_ref) = quantised_layers(k_cache, v_cache, kv, dtype)
    scale = head_dim**-0.5
    out = TritonAttentionBackend(kv).forward(query, k_layer, v_layer, meta, scale)
    assert out.shape == query.shape and out.dtype == dtype
    got = out.cpu().double()
    assert torch.isfinite(got).all(), "NaN/inf: the kernel read an unused slot or block"
    ref = reference_attention(query, k_ref, v_ref, meta, scale)
    torch.testing.assert_close(got, ref, **quantised_tolerance(dtype))


def quantised_tolerance(dtype: torch.dtype) -> dict[str, float]:
    # Compiled, a float32 model over a quantised pool takes tf32 products (triton_launch.py);
    # the interpreter computes them in float32.
    if dtype == torch.float32 and DEVICE.type == "cuda":
        return TOLERANCES[torch.float16]
    return TOLERANCES[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_mixed_batch_over_a_quantised_pool_matches_float64(kv, dtype):
    check_quantised(MIXED, kv, dtype)


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_quantised_decode_gqa8_padded_head_dim_and_large_blocks(kv):
    # decode-only launch constants, GQA 8, head_dim 80 padded to 128, blocks of 32
    check_quantised([(1, 1), (1, 17), (1, 40)], kv, torch.bfloat16, block_size=32, group=8,
                    head_dim=80, num_kv_heads=1)  # fmt: skip


# ------------------------------------------------------------------------------------------------
# The e4m3 codec, element by element


@triton.jit
def _encode(src, dst, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(dst + i, fp8_encode(tl.load(src + i)).to(tl.uint8))


@triton.jit
def _decode(src, dst, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(dst + i, fp8_to_half(tl.load(src + i)).to(tl.float32) * 256.0)


def test_e4m3_decoder_reads_every_code_and_encoder_rounds_every_tie_to_even():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = torch.empty(256, device=DEVICE)
    _decode[(1,)](codes.to(DEVICE), values, N=256)
    want = e4m3_decode(codes)
    got = values.cpu().double()
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~want.isnan()], want[~want.isnan()])

    grid = want[:128][~want[:128].isnan()]
    mids = (grid[1:] + grid[:-1]) / 2
    g = torch.Generator().manual_seed(0)
    x = torch.cat([grid, -grid, mids, -mids, (torch.rand(1000, generator=g) - 0.5) * 896,
                   torch.randn(500, generator=g) * 0.01])  # fmt: skip
    n = 4096
    assert x.numel() <= n
    padded = torch.zeros(n, dtype=torch.float32)
    padded[: x.numel()] = x.float()
    out = torch.empty(n, dtype=torch.uint8, device=DEVICE)
    _encode[(1,)](padded.to(DEVICE), out, N=n)
    got_codes = out.cpu()[: x.numel()]
    want_codes = e4m3_round(padded[: x.numel()].double())
    assert torch.equal(e4m3_decode(got_codes), e4m3_decode(want_codes))
    nonzero = e4m3_decode(want_codes) != 0  # +-0 are one value
    assert torch.equal(got_codes[nonzero], want_codes[nonzero])


# ------------------------------------------------------------------------------------------------
# The KV-write kernel


def _step_kv(dtype: torch.dtype, h_kv: int, d: int, spread: torch.Tensor | None = None):
    """6 tokens of K and V as strided views of one fused projection output, and their slots
    (two are -1: written nowhere)."""
    g = torch.Generator().manual_seed(1)
    fused = torch.randn(6, 2 * h_kv * d + 5, generator=g)
    if spread is not None:
        fused = fused * spread
    fused = fused.to(device=DEVICE, dtype=dtype)
    key = fused[:, : h_kv * d].view(6, h_kv, d)
    value = fused[:, h_kv * d : 2 * h_kv * d].view(6, h_kv, d)
    assert not key.is_contiguous()
    slots = torch.tensor([5, -1, 16 * 3 + 15, 0, -1, 33], dtype=torch.int64, device=DEVICE)
    return key, value, slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_write_stores_the_formats_codes_and_scales(dtype):
    blocks, bs, h_kv, d = 4, 16, 3, 64
    key, value, slots = _step_kv(dtype, h_kv, d)
    key[3, 1] = 0.0  # an all-zero row: the smallest scale, zero codes
    layers = [QuantizedKV(torch.full((blocks, bs, h_kv, d), 99, dtype=torch.int8, device=DEVICE),
                          torch.full((blocks, bs, h_kv), float("nan"), dtype=torch.float16,
                                     device=DEVICE), dtype)
              for _ in range(2)]  # fmt: skip
    TritonAttentionBackend("int8").write_kv(key, value, *layers, slots)
    written = slots >= 0
    for layer, x in zip(layers, (key, value), strict=True):
        codes = layer.data.view(-1, h_kv, d).cpu()
        scale = layer.scale.view(-1, h_kv).cpu()
        rows = slots[written].cpu()
        stored = codes[rows].double() * scale[rows].double()[..., None]
        torch.testing.assert_close(stored, int8_round_trip(x[written].cpu()), rtol=0, atol=0)
        # the same bytes as the torch path writes (a pool is read by either backend)
        q, s = quantize_int8(x[written].cpu())
        assert torch.equal(codes[rows], q) and torch.equal(scale[rows], s)
        untouched = torch.ones(codes.shape[0], dtype=torch.bool)
        untouched[rows] = False
        assert (codes[untouched] == 99).all() and scale[untouched].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_write_stores_the_formats_codes_saturating_out_of_range(dtype):
    blocks, bs, h_kv, d = 4, 16, 3, 64
    # values from 1e-4 to 3e3 x the scale: subnormal codes up to saturation at 448
    spread = torch.cat([torch.logspace(-4, 3.5, h_kv * d).repeat(2), torch.ones(5)])
    key, value, slots = _step_kv(dtype, h_kv, d, spread)
    scales = (2.0**-3, 1.0)
    layers = [Fp8KV(torch.full((blocks, bs, h_kv, d), 0x7F, dtype=torch.uint8,
                               device=DEVICE).view(FP8_DTYPE), torch.tensor(s, device=DEVICE),
                    dtype)
              for s in scales]  # fmt: skip
    TritonAttentionBackend("fp8").write_kv(key, value, *layers, slots)
    written = slots >= 0
    rows = slots[written].cpu()
    for layer, x, s in zip(layers, (key, value), scales, strict=True):
        codes = layer.data.view(torch.uint8).view(-1, h_kv, d).cpu()
        want = e4m3_round(x[written].cpu().double() / s)
        assert torch.equal(e4m3_decode(codes[rows]), e4m3_decode(want))
        assert (e4m3_decode(codes[rows]).abs() == 448).any()  # saturation was exercised
        untouched = torch.ones(codes.shape[0], dtype=torch.bool)
        untouched[rows] = False
        assert (codes[untouched] == 0x7F).all()


# ------------------------------------------------------------------------------------------------
# The engine


@pytest.mark.slow
@pytest.mark.parametrize(("kv", "graphs"), [("int8", False), ("fp8", False), ("fp8", True)])
def test_triton_engine_logits_are_the_float64_forward_of_its_quantised_kv(kv, graphs):
    ck = fp8_engine_tests.skewed_checkpoint()
    engine = LLMEngine(
        EngineConfig(kv_cache_dtype=kv, attention_backend="triton", device=DEVICE.type,
                     num_kv_blocks=64, long_prefill_chunk=9, max_num_batched_tokens=9,
                     cuda_graphs=False),
        checkpoint=ck,
    )  # fmt: skip
    assert engine.backend.name == f"triton-{kv}"
    if graphs:  # decode steps replayed from (stand-in) graphs: static buffers, scale pointers
        interpreted_triton()
        engine.runner.enable_decode_graphs(2, 128, make_graph=EagerReplayGraph)
    if kv == "fp8":
        scales = [(k.scale.item(), v.scale.item()) for k, v in engine.runner.kv_caches]
        transform = fp8_engine_tests.fp8_transform(scales)
    else:

        def transform(layer, k, v):
            return int8_round_trip(k), int8_round_trip(v)

    fp8_engine_tests.check_against_fake_quant_reference(engine, ck, transform)
    # every decode step replayed (and the prompt's last one-token chunk: 37 = 4 x 9 + 1)
    assert engine.runner.num_graph_steps == (fp8_engine_tests.STEPS if graphs else 0)


def test_a_backend_takes_only_layers_of_its_format():
    query, k_cache, v_cache, meta = make_batch(
        [(2, 5)], block_size=16, num_heads=2, num_kv_heads=1, head_dim=64, dtype=torch.float32
    )
    (k8, v8), _ = quantised_layers(k_cache, v_cache, "int8", torch.float32)
    with pytest.raises(ValueError, match="k_cache must be an Fp8KV for kv_cache_dtype='fp8'"):
        TritonAttentionBackend("fp8").forward(query, k8, v8, meta, 0.125)
    with pytest.raises(ValueError, match="k_cache must be a torch.Tensor"):
        TritonAttentionBackend().forward(query, k8, v8, meta, 0.125)
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('auto', 'int8', 'fp8'"):
        TritonAttentionBackend("fp4")
    bad = QuantizedKV(k8.data, k8.scale.float(), torch.float32)  # float32 scales
    with pytest.raises(ValueError, match="scales must be float16"):
        TritonAttentionBackend("int8").write_kv(query[:, :1], query[:, :1], bad, v8,
                                                meta.slot_mapping)  # fmt: skip
