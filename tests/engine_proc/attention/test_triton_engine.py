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
