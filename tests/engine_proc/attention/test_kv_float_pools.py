"""Float KV pools of another type than the model's (kv_cache_dtype "fp16" / "fp32"; the torch
backend casts, engine_proc/attention/torch_ref.py): what "auto" resolves to
(kv_quant.resolve_kv_cache_dtype), the pool's element type and bytes, and an fp16-KV engine's
logits against a float64 forward whose K/V are rounded to float16 (tests/float64_llama.py).
The fused CPU step reading such a pool: tests/engine_proc/executor/test_fused_decode.py."""

from __future__ import annotations

import pytest
import torch

from engine_proc import EngineConfig, LLMEngine
from engine_proc.attention import select_backend
from engine_proc.attention.kv_quant import resolve_kv_cache_dtype
from tests.engine_fixtures import tiny_checkpoint
from tests.engine_proc.attention.test_kv_fp8 import (
    PROMPT,
    STEPS,
    record_greedy_logits,
    reference_logits,
    skewed_checkpoint,
)

# float32 against float64 arithmetic, plus the rare K/V element whose float32 value rounds to
# the other float16 neighbour than its float64 value (one float16 step of one element)
LOGIT_ATOL = 1e-4


def fp16_transform(layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return k.half().double(), v.half().double()


@pytest.mark.parametrize("native_bf16", [False, True])
def test_auto_is_fp16_beside_4bit_decode_on_avx512_bf16_and_the_model_dtype_elsewhere(
    native_bf16,
):
    def r(kv: str, dtype: torch.dtype, weights: str) -> str:
        return resolve_kv_cache_dtype(kv, dtype, weights, native_bf16)

    assert r("auto", torch.float32, "int4") == ("fp16" if native_bf16 else "auto")
    assert r("auto", torch.float32, "dense") == "auto"
    assert r("auto", torch.bfloat16, "dense") == "auto"
    # a float pool of the model's own type has one name
    assert r("fp32", torch.float32, "int4") == "auto"
    assert r("fp16", torch.float16, "dense") == "auto"
    assert r("fp16", torch.float32, "dense") == "fp16"
    assert r("fp32", torch.bfloat16, "dense") == "fp32"
    assert r("int8", torch.float32, "int4") == "int8"


@pytest.mark.parametrize("native_bf16", [False, True])
def test_an_int4_engine_resolves_auto_by_the_cpu(native_bf16, monkeypatch):
    from engine_proc.models import layers

    monkeypatch.setattr(layers, "cpu_has_native_bf16", lambda: native_bf16)
    engine = LLMEngine(EngineConfig(num_kv_blocks=16, decode_weights="int4"),
                       checkpoint=tiny_checkpoint())  # fmt: skip
    want = torch.float16 if native_bf16 else torch.float32
    assert engine.runner.kv_cache.dtype == want
    assert engine.model_info()["kv_cache_dtype"] == ("fp16" if native_bf16 else "auto")


def test_an_fp16_pool_holds_float16_values_at_half_the_bytes():
    ck = tiny_checkpoint()
    engine = LLMEngine(EngineConfig(kv_cache_dtype="fp16", num_kv_blocks=64), checkpoint=ck)
    auto = LLMEngine(EngineConfig(num_kv_blocks=64), checkpoint=ck)
    assert engine.runner.kv_cache.dtype == torch.float16
    assert engine.kv_bytes_per_token * 2 == auto.kv_bytes_per_token
    assert engine.model_info()["kv_cache_dtype"] == "fp16"
    assert "|kv_dtype=fp16|" in engine.cache_identity  # its blocks are not the float32 ones
    sized = LLMEngine(EngineConfig(kv_cache_dtype="fp16", kv_cache_memory=1 << 20), checkpoint=ck)
    assert sized.num_blocks == (1 << 20) // (engine.kv_bytes_per_token * sized.block_size)


def test_bad_float_pools_are_refused_with_the_allowed_values():
    with pytest.raises(ValueError, match=r"one of \('auto', 'fp32', 'fp16', 'int8', 'fp8'\)"):
        EngineConfig(kv_cache_dtype="fp64")
    with pytest.raises(ValueError, match="runs on the torch attention backend only"):
        select_backend("triton", torch.device("cpu"), "fp16")


def test_fp16_engine_logits_are_the_float64_forward_of_float16_kv():
    """Chunked prefill, then decode steps, all reading K/V back from the float16 pool."""
    ck = skewed_checkpoint()
    engine = LLMEngine(
        EngineConfig(kv_cache_dtype="fp16", num_kv_blocks=64, long_prefill_chunk=9,
                     max_num_batched_tokens=9),
        checkpoint=ck,
    )  # fmt: skip
    tokens, logits = record_greedy_logits(engine, PROMPT, STEPS)
    ids = PROMPT + tokens
    rows = slice(len(PROMPT) - 1, len(ids) - 1)
    ref = reference_logits(ck, ids, fp16_transform)[rows]
    assert (logits - ref).abs().max().item() < LOGIT_ATOL
    # the rounding is visible: a pool that kept float32 values would fail
    exact = reference_logits(ck, ids)[rows]
    assert (ref - exact).abs().max().item() > 10 * LOGIT_ATOL
