"""fp8 KV cache (engine_proc/attention/kv_fp8.py) on the torch path: the quantiser against a
brute-force e4m3 grid, the per-layer scales against a float64 recount of the calibration
forward, and an fp8 engine's logits against a float64 forward whose K/V go through the same
quantisation (tests/float64_llama.py), and against the auto-dtype engine."""

from __future__ import annotations

import math

import pytest
import torch

from engine_proc import EngineConfig, LLMEngine, SamplingParams
from engine_proc.attention.kv_fp8 import (
    FP8_MAX,
    HEADROOM,
    calibration_token_ids,
    quantize_fp8,
    scale_for,
)
from tests.engine_fixtures import tiny_checkpoint
from tests.engine_proc.attention.kv_references import e4m3_decode, e4m3_round, fp8_round_trip
from tests.float64_llama import llama_forward


def test_quantiser_rounds_to_the_nearest_e4m3_value_ties_to_even():
    grid = e4m3_decode(torch.arange(128))
    grid = grid[~grid.isnan()]
    mids = (grid[1:] + grid[:-1]) / 2  # exact ties, all representable in float32
    g = torch.Generator().manual_seed(0)
    x = torch.cat([grid, -grid, mids, -mids, torch.randn(2000, generator=g, dtype=torch.float64)
                   * 100, torch.tensor([1e4, -1e4, 449.0, 1e-9, 0.0])])  # fmt: skip
    for scale in (1.0, 2.0**-5, 0.3):
        xs = (x * scale).float()
        codes = quantize_fp8(xs, scale).view(torch.uint8)
        # the format divides in float32 (exact for the power-of-two scales calibration picks)
        want = e4m3_round((xs / scale).double())
        # -0.0 and +0.0 are the same value; compare values, and codes of nonzero values
        assert torch.equal(e4m3_decode(codes), e4m3_decode(want))
        nonzero = e4m3_decode(want) != 0
        assert torch.equal(codes[nonzero], want[nonzero])
    assert quantize_fp8(torch.tensor([1e6, -1e6]), 1.0).float().tolist() == [448.0, -448.0]


@pytest.mark.parametrize("amax", [1e-9, 0.01, 0.75, 1.0, 27.3, 224.0, 5000.0])
def test_scale_is_the_smallest_power_of_two_that_keeps_headroom(amax):
    s = scale_for(amax)
    k = math.log2(s)
    assert k == int(k)
    # the documented contract: values up to twice the calibration's largest stay in range
    assert HEADROOM == 2.0
    fits = [2.0**j for j in range(-40, 40) if max(amax, 1e-6) * 2.0 / 2.0**j <= FP8_MAX]
    assert s == min(fits)


def _calibration_amax(ck, ids):
    """Per layer, max |K| and |V| of a float64 forward over ids."""
    seen: list[tuple[float, float]] = []

    def record(layer, k, v):
        seen.append((k.abs().max().item(), v.abs().max().item()))
        return k, v

    llama_forward(ck.config, ck.weights, ids, kv_transform=record)
    return seen


def skewed_checkpoint():
    """The tiny model with layer 0's V and layer 1's K scaled up: its fp8 scales then differ
    between layers and between K and V, so a scale applied to the wrong tensor shows."""
    ck = tiny_checkpoint()
    ck.weights["model.layers.0.self_attn.v_proj.weight"] *= 16
    ck.weights["model.layers.1.self_attn.k_proj.weight"] *= 4
    return ck


def _fp8_engine(ck, **config):
    return LLMEngine(EngineConfig(kv_cache_dtype="fp8", num_kv_blocks=64, **config), checkpoint=ck)


def test_calibration_scales_follow_a_float64_recount_and_bytes_per_token():
    ck = skewed_checkpoint()
    engine = _fp8_engine(ck)
    got = torch.stack([torch.stack([k.scale, v.scale]) for k, v in engine.runner.kv_caches])
    amax = _calibration_amax(ck, calibration_token_ids(engine.tokenizer))
    want = torch.tensor([[scale_for(k), scale_for(v)] for k, v in amax], dtype=torch.float32)
    assert torch.equal(got, want)
    assert len(set(want.flatten().tolist())) >= 3  # the skew shows in the scales
    mc = engine.model_config
    assert engine.kv_bytes_per_token == 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim
    assert engine.runner.kv_cache.dtype == torch.float8_e4m3fn
    # the pool's size in blocks follows from the byte budget at 1 byte per value
    sized = LLMEngine(EngineConfig(kv_cache_dtype="fp8", kv_cache_memory=1 << 20), checkpoint=ck)
    assert sized.num_blocks == (1 << 20) // (engine.kv_bytes_per_token * sized.block_size)


def record_greedy_logits(engine, prompt, n):
    """Greedy tokens and the float32 logits each was sampled from."""
    rows: list[torch.Tensor] = []
    compute = engine.model.compute_logits

    def recording(hidden):
        out = compute(hidden)
        rows.append(out.detach().double())
        return out

    engine.model.compute_logits = recording
    try:
        out = engine.generate([prompt], SamplingParams(max_tokens=n, temperature=0,
                                                       ignore_eos=True))[0]  # fmt: skip
    finally:
        engine.model.compute_logits = compute
    return out.token_ids, torch.cat(rows)


def reference_logits(ck, ids, kv_transform=None):
    return llama_forward(ck.config, ck.weights, ids, kv_transform=kv_transform).logits


def fp8_transform(scales):
    def apply(layer, k, v):
        return fp8_round_trip(k, scales[layer][0]), fp8_round_trip(v, scales[layer][1])

    return apply


PROMPT = [(5 * j + 3) % 120 + 3 for j in range(37)]
STEPS = 6
# fp32 vs float64 arithmetic (~1e-6), plus the rare K/V element whose float32 value lands on the
# other side of an e4m3 rounding midpoint than its float64 value (one e4m3 step of one element)
LOGIT_ATOL = 2e-3


def check_against_fake_quant_reference(engine, ck, transform):
    """The engine's greedy logits (chunked prefill, then decode steps reading the quantised
    cache) are a float64 forward's whose K/V pass through ``transform``."""
    tokens, logits = record_greedy_logits(engine, PROMPT, STEPS)
    ids = PROMPT + tokens
    ref = reference_logits(ck, ids, transform)[len(PROMPT) - 1 : len(ids) - 1]
    assert (logits - ref).abs().max().item() < LOGIT_ATOL
    return tokens, logits, ids, ref


def test_fp8_engine_logits_are_the_float64_forward_of_fp8_kv_and_close_to_auto():
    ck = skewed_checkpoint()
    engine = _fp8_engine(ck, long_prefill_chunk=9, max_num_batched_tokens=9)
    scales = [(k.scale.item(), v.scale.item()) for k, v in engine.runner.kv_caches]
    tokens, logits, ids, ref = check_against_fake_quant_reference(engine, ck, fp8_transform(scales))
    # Closeness to the auto engine is what the quantisation itself predicts: the float64
    # forwards with and without fp8 K/V differ by `expected`; the engines by as much, give or
    # take the float32 slack above.
    exact = reference_logits(ck, ids)[len(PROMPT) - 1 : len(ids) - 1]
    auto = LLMEngine(EngineConfig(num_kv_blocks=64, long_prefill_chunk=9,
                                  max_num_batched_tokens=9), checkpoint=ck)  # fmt: skip
    auto_tokens, auto_logits = record_greedy_logits(auto, PROMPT, STEPS)
    # rows up to the first token the two engines choose differently share their context
    pairs = enumerate(zip(tokens, auto_tokens, strict=True))
    same = next((i for i, (a, b) in pairs if a != b), STEPS - 1)
    rows = slice(0, same + 1)
    expected = (ref[rows] - exact[rows]).abs().max().item()
    gap = (logits[rows] - auto_logits[rows]).abs().max().item()
    assert abs(gap - expected) < 2 * LOGIT_ATOL
    # and the quantisation is visible at all: an fp8 engine that stored exact K/V would fail
    assert expected > 10 * LOGIT_ATOL


def test_fp8_scales_are_part_of_the_cache_identity(monkeypatch):
    """Blocks stored under one set of fp8 scales must never be hit (disk tier, a decode engine
    pulling them) by an engine whose scales differ: the scales' digest roots the hash chain."""
    from engine_proc.engine import llm_engine as engine_module

    def make() -> LLMEngine:
        return LLMEngine(EngineConfig(kv_cache_dtype="fp8", num_kv_blocks=16, device="cpu"),
                         checkpoint=tiny_checkpoint())  # fmt: skip

    first, again = make(), make()
    assert first.cache_identity == again.cache_identity
    assert "|fp8_scales=" in first.cache_identity
    calibrate = engine_module.calibrate_fp8_scales
    monkeypatch.setattr(engine_module, "calibrate_fp8_scales",
                        lambda *a, **k: calibrate(*a, **k) * 2)  # fmt: skip
    assert make().cache_identity != first.cache_identity
