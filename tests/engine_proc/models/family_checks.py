"""Checks shared by the per-family test files (test_phi3.py, test_gemma2.py, test_moe.py): a
layout is (architecture, parameters of tiny_model_dir, or of tiny_moe_model_dir for the
routed-experts architectures); the engine against transformers' own float32 forward
and generate() on the tiny checkpoint, and the GGUF of the same weights read by our loader."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from engine_proc import EngineConfig, LLMEngine, SamplingParams
from tests.engine_proc.models.test_llama import all_position_logits
from tests.tiny_models import (
    MOE_ARCHITECTURES,
    hf_reference_model,
    tiny_gguf_file,
    tiny_model_dir,
    tiny_moe_gguf_file,
    tiny_moe_model_dir,
)

PROMPT = torch.randint(3, 49152, (45,), generator=torch.Generator().manual_seed(1)).tolist()
NEW_TOKENS = 12
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)

Layout = tuple[str, dict]


def checkpoint_path(layout: Layout, gguf: bool = False):
    """The layout's tiny HF directory, or the GGUF of the same weights."""
    arch, params = layout
    if arch in MOE_ARCHITECTURES:
        return tiny_moe_gguf_file(arch, **params) if gguf else tiny_moe_model_dir(arch, **params)
    return tiny_gguf_file(arch, **params) if gguf else tiny_model_dir(arch, **params)


def engine_for(layout: Layout, block_size: int = 16, gguf: bool = False,
               **overrides) -> LLMEngine:  # fmt: skip
    path = checkpoint_path(layout, gguf)
    config = dict(model=str(path), block_size=block_size, num_kv_blocks=200,
                  long_prefill_chunk=11)  # fmt: skip
    return LLMEngine(EngineConfig(**(config | overrides)))


def reference(layout: Layout):
    return hf_reference_model(checkpoint_path(layout))


def reference_logits(layout: Layout, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return reference(layout)(torch.tensor([prompt])).logits[0].float()


def reference_greedy(layout: Layout, prompt: list[int]) -> list[int]:
    out = reference(layout).generate(
        torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long), eos_token_id=None,
        pad_token_id=0,
    )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def check_logits_and_greedy(layout: Layout, block_size: int, prompt: list[int]) -> LLMEngine:
    """Logits at every prompt position (chunked prefill through the paged cache) within 1e-4 of
    transformers', greedy tokens equal to generate()'s, and again from the prefix cache."""
    engine = engine_for(layout, block_size)
    ours = all_position_logits(engine, prompt)
    ref = reference_logits(layout, prompt)
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    ref_ids = reference_greedy(layout, prompt)
    (cold,) = engine.generate([prompt], GREEDY)
    assert cold.token_ids == ref_ids
    (warm,) = engine.generate([prompt], GREEDY)
    assert warm.num_cached_tokens >= len(prompt) // block_size * block_size - block_size
    assert warm.num_cached_tokens > 0 and warm.token_ids == ref_ids
    assert engine.kv.pool.num_free == engine.num_blocks
    return engine


def check_preemption(layout: Layout) -> None:
    check_preemption_with(functools.partial(engine_for, layout))


def check_preemption_with(make: Callable[..., LLMEngine]) -> None:
    """4 requests of 45 + 12 tokens need 4 x 4 blocks of 16; 9 blocks force preemptions. A
    model whose every layer slides over a short window holds at most 3 blocks a request (the
    window's 2 once decoding): there 5 blocks do."""
    prompts = [PROMPT[i:] + PROMPT[:i] for i in range(0, 40, 10)]
    roomy = make().generate(prompts, GREEDY)
    tight = make(num_kv_blocks=9, enable_prefix_caching=False)
    if tight.kv_layout.windows[0] is not None:
        tight = make(num_kv_blocks=5, enable_prefix_caching=False)
    outs = tight.generate(prompts, GREEDY)
    assert tight.stats.num_preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]
    assert tight.kv.pool.num_free == tight.num_blocks


def check_gguf(layout: Layout, prompt: list[int]) -> None:
    """The GGUF written as llama.cpp's converter does: every ModelConfig field read from its
    metadata equal to the HF directory's, and transformers' logits."""
    engine = engine_for(layout, gguf=True, num_kv_blocks=64)
    assert engine.model_config == engine_for(layout).model_config
    ours = all_position_logits(engine, prompt)
    torch.testing.assert_close(ours, reference_logits(layout, prompt), atol=1e-4, rtol=1e-4)


def check_llama_cpp(layout: Layout, prompt: list[int]) -> None:
    """The GGUF writer checked by a reader we did not write: llama.cpp's own forward on it
    gives transformers' logits (optional: needs llama-cpp-python)."""
    import pytest

    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    f32 = 0  # GGML_TYPE_F32: a float32 KV cache (llama.cpp's default is f16)
    llm = llama_cpp.Llama(str(checkpoint_path(layout, gguf=True)), n_ctx=128, logits_all=True,
                          verbose=False, n_threads=2, type_k=f32, type_v=f32)  # fmt: skip
    llm.eval(prompt)
    theirs = torch.tensor(llm.scores[: len(prompt)], dtype=torch.float32)
    ref = reference_logits(layout, prompt)
    # llama.cpp rounds some products through f16 (test_families.py: 3.5e-3 seen)
    torch.testing.assert_close(theirs, ref, atol=1e-2, rtol=1e-3)
    assert torch.equal(theirs.argmax(-1), ref.argmax(-1))
