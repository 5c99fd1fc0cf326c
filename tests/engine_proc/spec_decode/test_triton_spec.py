"""Speculative rows (1 + k tokens after cached context) through the Triton attention kernels
(interpreted on CPU, native on CUDA): transformers' greedy tokens, drafts accepted and rejected."""

from __future__ import annotations

import pytest
import torch

from engine_proc import EngineConfig, LLMEngine, SamplingParams
from tests.engine_proc.spec_decode.test_engine_spec import ALPHABET, PROMPTS, SPEC
from tests.needs import triton_device
from tests.tiny_models import hf_reference_model, tiny_model_dir


@pytest.mark.slow
def test_triton_speculative_rows_give_transformers_greedy_tokens() -> None:
    device = triton_device()
    path = tiny_model_dir(
        "llama", num_heads=4, num_kv_heads=2, num_layers=2, max_position_embeddings=1024
    )
    config = EngineConfig(model=str(path), attention_backend="triton", device=device,
                          num_kv_blocks=64, block_size=4, speculative_config=SPEC)  # fmt: skip
    engine = LLMEngine(config)
    assert engine.backend.name == "triton"
    prompts = PROMPTS[:2]
    params = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, logit_bias=ALPHABET)
    ours = [o.token_ids for o in engine.generate(prompts, params)]
    model = hf_reference_model(path)
    for prompt, got in zip(prompts, ours, strict=True):
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=14, min_new_tokens=14, do_sample=False, pad_token_id=2,
            sequence_bias={(t,): b for t, b in ALPHABET.items()},
        )  # fmt: skip
        assert got == out[0, len(prompt) :].tolist()
    s = engine.stats.spec_decode
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens
    assert engine.kv.pool.num_free == engine.num_blocks
