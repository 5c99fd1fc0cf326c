"""End to end: a tiny random Llama generates transformers' greedy tokens with the Triton kernels
(interpreted on CPU, native on CUDA), chunked prompts and mixed prefill/decode steps included.
The model is tests/tiny_models/' Llama, whose attention is far from uniform: a wrong kernel changes
its tokens."""

import pytest

from engine_proc import EngineConfig, LLMEngine, SamplingParams
from tests.engine_fixtures import greedy_reference
from tests.needs import triton_device
from tests.tiny_models import hf_reference_model, tiny_model_dir


@pytest.mark.slow
def test_triton_backend_generates_transformers_greedy_tokens():
    device = triton_device()
    path = tiny_model_dir(
        "llama", num_heads=4, num_kv_heads=2, num_layers=2, max_position_embeddings=1024
    )
    engine = LLMEngine(
        EngineConfig(
            model=str(path),
            attention_backend="triton",
            device=device,
            num_kv_blocks=64,
            block_size=16,
            long_prefill_chunk=9,
        )
    )
    assert engine.backend.name == "triton"
    prompts = [list(range(500, 521)), list(range(4000, 4007)), [3001] * 18]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    ours = [o.token_ids for o in engine.generate(prompts, params)]
    reference = greedy_reference(hf_reference_model(path))
    assert ours == [reference(p, 6) for p in prompts]


# Sliding windows shorter than the prompt: Gemma 2 (soft-capped scores, every other layer
# sliding), Gemma 3 (the hybrid cache: sliding groups release blocks), Mistral (every layer
# slides: its one table releases blocks)
WINDOWED = {
    "gemma2": ("gemma2", dict(num_heads=4, num_kv_heads=2, sliding_window=8,
                              tie_word_embeddings=True)),
    "gemma3": ("gemma3", dict(num_heads=4, num_kv_heads=2, num_layers=4, sliding_window=8,
                              layer_types=("sliding_attention", "sliding_attention",
                                           "full_attention", "sliding_attention"))),
    "mistral": ("mistral", dict(num_heads=4, num_kv_heads=2, sliding_window=5)),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WINDOWED))
def test_windows_and_caps_on_the_triton_backend_give_transformers_logits(name):
    import torch

    from tests.engine_proc.models.family_checks import (
        GREEDY,
        PROMPT,
        engine_for,
        reference_greedy,
        reference_logits,
    )
    from tests.engine_proc.models.test_llama import all_position_logits

    layout = WINDOWED[name]
    engine = engine_for(layout, attention_backend="triton", device=triton_device())
    assert engine.backend.name == "triton" and engine.kv_layout.has_sliding_groups
    ours = all_position_logits(engine, PROMPT).cpu()
    torch.testing.assert_close(ours, reference_logits(layout, PROMPT), atol=1e-4, rtol=1e-4)
    (out,) = engine.generate([PROMPT], GREEDY)
    assert out.token_ids == reference_greedy(layout, PROMPT)
    assert engine.kv.pool.num_free == engine.num_blocks
