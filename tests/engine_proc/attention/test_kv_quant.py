"""Quantised KV caches on the torch path (engine_proc/attention/kv_quant.py, kv_fp8.py) against
float64 brute force: the int8 quantiser's rounding bound, and paged attention over int8 and fp8
K/V against attention computed in float64 from the stored codes, which must be what each
format's definition stores (tests/engine_proc/attention/kv_references.py)."""

from __future__ import annotations

import math

import pytest
import torch

from engine_proc import EngineConfig, LLMEngine, SamplingParams
from engine_proc.attention.base import AttentionMetadata
from engine_proc.attention.kv_fp8 import FP8_DTYPE, Fp8KV
from engine_proc.attention.kv_quant import (
    Fp8TorchAttentionBackend,
    Int8TorchAttentionBackend,
    QuantizedKV,
    kv_int8_bytes_per_token,
    quantize_int8,
)
from tests.engine_fixtures import greedy_reference
from tests.engine_proc.attention.kv_references import e4m3_decode, fp8_round_trip, int8_round_trip
from tests.tiny_models import hf_reference_model, tiny_model_dir


def test_quantiser_rounds_each_row_to_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=g, dtype=torch.float64) * torch.rand(50, 3, 1) * 20
    x[0, 0] = 0.0  # an all-zero row must not divide by zero
    q, s = quantize_int8(x.float())
    assert q.dtype == torch.int8 and s.dtype == torch.float16 and s.shape == (50, 3)
    # Brute force, row by row in float64.
    for i in range(50):
        for h in range(3):
            row = x[i, h]
            step = float(s[i, h])
            assert step == pytest.approx(
                max(row.abs().max().item() / 127, 1e-5), rel=1e-3, abs=1e-7
            )
            deq = q[i, h].double() * step
            assert (deq - row).abs().max().item() <= step / 2 * (1 + 1e-3) + 1e-6 * step
            assert q[i, h].abs().max().item() <= 127


def _brute_attention(q, k, v, ctx_lens, q_lens, scale):
    """float64, per sequence and head: softmax over keys 0..position."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    heads, kv_heads = q.shape[1], k[0].shape[1]
    t = 0
    for s, (ql, total) in enumerate(zip(q_lens, ctx_lens, strict=True)):
        for i in range(ql):
            pos = total - ql + i
            for h in range(heads):
                kh = k[s][: pos + 1, h * kv_heads // heads]
                vh = v[s][: pos + 1, h * kv_heads // heads]
                w = torch.softmax((kh @ q[t, h].double()) * scale, dim=0)
                out[t, h] = w @ vh
            t += 1
    return out


def _quantized_pool(kv: str, dtype: torch.dtype, blocks: int, bs: int, kv_heads: int, dim: int):
    """(backend, K layer, V layer, float64 read-back of the stored K and V by slot)."""
    shape = (blocks, bs, kv_heads, dim)
    if kv == "int8":
        layers = [QuantizedKV(torch.zeros(shape, dtype=torch.int8),
                              torch.ones(shape[:-1], dtype=torch.float16), dtype)
                  for _ in range(2)]  # fmt: skip

        def stored(layer):
            return (layer.data.double() * layer.scale.double()[..., None]).view(-1, kv_heads, dim)

        return Int8TorchAttentionBackend(), *layers, stored
    # K and V at their own per-layer scales (powers of two, as calibration picks them)
    layers = [Fp8KV(torch.zeros(shape, dtype=FP8_DTYPE), torch.tensor(s), dtype)
              for s in (2.0**-5, 2.0**-6)]  # fmt: skip

    def stored(layer):
        return (e4m3_decode(layer.data.view(torch.uint8)) * layer.scale.item()).view(
            -1, kv_heads, dim
        )

    return Fp8TorchAttentionBackend(), *layers, stored


@pytest.mark.parametrize("kv", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantised_paged_attention_matches_float64_brute_force(kv, dtype):
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, bs, blocks = 4, 2, 16, 4, 24
    backend, k_cache, v_cache, stored = _quantized_pool(kv, dtype, blocks, bs, kv_heads, dim)
    # Sequence 0: a prompt chunk of 5 after 6 cached tokens; 1: a fresh prompt of 7;
    # 2 and 3: decodes with 9 and 13 tokens of context.
    seq_lens, q_lens = [11, 7, 10, 14], [5, 7, 1, 1]
    tables = torch.full((4, 4), -1, dtype=torch.int32)
    free = iter(torch.randperm(blocks, generator=g).tolist())
    for s, n in enumerate(seq_lens):
        for j in range(-(-n // bs)):
            tables[s, j] = next(free)
    # Fill the cached context through the backend's own write, then the step's tokens.
    full_k = [torch.randn(n, kv_heads, dim, generator=g) * 3 for n in seq_lens]
    full_v = [torch.randn(n, kv_heads, dim, generator=g) for n in seq_lens]
    slots = [
        [int(tables[s, p // bs]) * bs + p % bs for p in range(n)] for s, n in enumerate(seq_lens)
    ]
    for s, (n, ql) in enumerate(zip(seq_lens, q_lens, strict=True)):
        idx = torch.tensor(slots[s][: n - ql], dtype=torch.int64)
        backend.write_kv(full_k[s][: n - ql].to(dtype), full_v[s][: n - ql].to(dtype),
                         k_cache, v_cache, idx)  # fmt: skip
    lens = list(enumerate(zip(seq_lens, q_lens, strict=True)))
    step_k = torch.cat([full_k[s][n - ql :] for s, (n, ql) in lens])
    step_v = torch.cat([full_v[s][n - ql :] for s, (n, ql) in lens])
    step_slots = [x for s, (n, ql) in lens for x in slots[s][n - ql :]]
    slot_mapping = torch.tensor(step_slots + [-1])  # a padding row writes nothing
    step_k = torch.cat([step_k, torch.zeros(1, kv_heads, dim)]).to(dtype)
    step_v = torch.cat([step_v, torch.zeros(1, kv_heads, dim)]).to(dtype)
    backend.write_kv(step_k, step_v, k_cache, v_cache, slot_mapping)
    q = (torch.randn(sum(q_lens), heads, dim, generator=g)).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=slot_mapping[:-1],
        query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=q_lens,
        seq_lens_cpu=seq_lens,
    )
    scale_f = 1 / math.sqrt(dim)
    out = backend.forward(q, k_cache, v_cache, meta, scale_f)
    # The reference reads the stored codes back in float64 (its own e4m3 decoding) ...
    deq_k = [stored(k_cache)[torch.tensor(sl)] for sl in slots]
    deq_v = [stored(v_cache)[torch.tensor(sl)] for sl in slots]
    ref = _brute_attention(q, deq_k, deq_v, seq_lens, q_lens, scale_f)
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    assert (out.double() - ref).abs().max().item() < tol
    # ... and those are what the format's definition stores of the written K/V.
    for s in range(4):
        for got, full, layer in ((deq_k[s], full_k[s], k_cache), (deq_v[s], full_v[s], v_cache)):
            x = full.to(dtype)
            want = int8_round_trip(x) if kv == "int8" else fp8_round_trip(x, layer.scale.item())
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_int8_pool_holds_about_twice_the_tokens_of_bf16_for_the_default_model_shape():
    # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64.
    bf16 = 2 * 30 * 3 * 64 * 2
    int8 = kv_int8_bytes_per_token(30, 3, 64)
    assert int8 == 2 * 30 * 3 * (64 + 2)
    assert bf16 / int8 >= 1.9


@pytest.fixture(scope="module")
def tiny_path():
    return tiny_model_dir(
        "llama", num_heads=4, num_kv_heads=2, num_layers=2, max_position_embeddings=1024
    )


@pytest.mark.slow
def test_int8_engine_gives_transformers_greedy_tokens(tiny_path):
    hf_greedy = greedy_reference(hf_reference_model(tiny_path))
    memory = 1 << 20
    int8 = LLMEngine(
        EngineConfig(model=str(tiny_path), kv_cache_dtype="int8", kv_cache_memory=memory)
    )
    auto = LLMEngine(EngineConfig(model=str(tiny_path), dtype="bfloat16", kv_cache_memory=memory))
    mc = int8.model_config
    assert int8.kv_bytes_per_token == 2 * mc.num_layers * mc.num_kv_heads * (mc.head_dim + 2)
    assert int8.num_blocks == memory // (int8.kv_bytes_per_token * int8.block_size)
    assert int8.num_blocks > auto.num_blocks
    prompts = [[1] + [(7 * i + 13 * j) % 49000 + 3 for j in range(40 + 9 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=8, temperature=0)
    outs = int8.generate(prompts, params)  # batched: prompt chunks and decodes read int8 K/V
    for p, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(p, 8)
