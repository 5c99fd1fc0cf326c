"""Gemma 2 (Gemma2ForCausalLM) against transformers' float32 forward and generate() on tiny
random checkpoints (tests/tiny_models/): alternating sliding-window / global layers with a
window shorter than the prompt, attention logit soft-capping and final logit soft-capping (the
tiny models' caps, 2 and 5, bend their scores and logits), sandwich norms with (1 + w) weights,
query_pre_attn_scalar, scaled embeddings, GELU-tanh; GQA, MQA, MHA, head_dim != hidden / heads,
tied and untied; block sizes 16 and 7, the prefix cache's second pass, preemption, and the GGUF
of the same weights as llama.cpp's converter writes it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.engine_proc.models.family_checks import (
    PROMPT,
    check_gguf,
    check_llama_cpp,
    check_logits_and_greedy,
    check_preemption,
    engine_for,
    reference_logits,
)
from tests.engine_proc.models.test_llama import all_position_logits

SLIDING, FULL = "sliding_attention", "full_attention"
LAYOUTS = {
    "gqa-tied-window8": ("gemma2", dict(num_kv_heads=2, sliding_window=8,
                                        tie_word_embeddings=True)),
    "mqa-tied-head_dim32-window6": ("gemma2", dict(num_kv_heads=1, head_dim=32, sliding_window=6,
                                                   tie_word_embeddings=True)),
    "mha-untied-scalar64-window8": ("gemma2", dict(num_kv_heads=4, sliding_window=8,
                                                   query_pre_attn_scalar=64)),
    "gqa-full-then-sliding-3-layers": ("gemma2", dict(num_layers=3, sliding_window=5,
                                                      layer_types=(FULL, SLIDING, SLIDING),
                                                      tie_word_embeddings=True)),
    "gqa-no-caps-window8": ("gemma2", dict(sliding_window=8, softcapping=(None, None),
                                           tie_word_embeddings=True)),
}  # fmt: skip
CASES = [(name, 16) for name in LAYOUTS] + [
    ("gqa-tied-window8", 7), ("mqa-tied-head_dim32-window6", 7)]  # fmt: skip


@pytest.mark.parametrize(("name", "block_size"), CASES, ids=[f"{n}-bs{b}" for n, b in CASES])
def test_logits_and_greedy_tokens_match_transformers(name, block_size):
    engine = check_logits_and_greedy(LAYOUTS[name], block_size, PROMPT)
    c = engine.model_config
    params = LAYOUTS[name][1]
    assert c.architecture == "Gemma2ForCausalLM" and c.sliding_window < len(PROMPT)
    assert c.layer_types == params.get("layer_types", (SLIDING, FULL))
    caps = params.get("softcapping", (2.0, 5.0))
    assert (c.attn_logit_softcap, c.final_logit_softcap) == caps
    assert c.tie_word_embeddings == params.get("tie_word_embeddings", False)


def test_the_caps_matter():
    """Without the caps our logits are far from transformers': the tests above see them."""
    layout = LAYOUTS["gqa-tied-window8"]
    engine = engine_for(layout, enable_prefix_caching=False)  # each pass computes every token
    ref = reference_logits(layout, PROMPT)
    torch.testing.assert_close(all_position_logits(engine, PROMPT), ref, atol=1e-4, rtol=1e-4)
    engine.model.config = dataclasses.replace(engine.model.config, attn_logit_softcap=None)
    assert (all_position_logits(engine, PROMPT) - ref).abs().max() > 0.1
    engine.model.config = dataclasses.replace(engine.model.config, attn_logit_softcap=2.0,
                                              final_logit_softcap=None)  # fmt: skip
    assert (all_position_logits(engine, PROMPT) - ref).abs().max() > 0.1


def test_gemma2_config_and_norms():
    engine = engine_for(LAYOUTS["mha-untied-scalar64-window8"])
    c = engine.model_config
    assert c.sandwich_norms and not c.qk_norm and c.hidden_act == "gelu_tanh"
    assert c.rope_local_theta is None and c.rope_scaling is None
    assert c.embed_scale == pytest.approx(64**0.5) and c.query_scale == pytest.approx(64**-0.5)
    from tests.engine_proc.models.family_checks import reference

    stored = reference(LAYOUTS["mha-untied-scalar64-window8"]).model.layers[0].input_layernorm
    torch.testing.assert_close(engine.model.layers[0].input_norm, stored.weight + 1.0)


@pytest.mark.parametrize("name", ["gqa-tied-window8", "mqa-tied-head_dim32-window6"])
def test_preemption_under_a_small_pool_changes_no_token(name):
    check_preemption(LAYOUTS[name])


# llama.cpp's converter drops lm_head (Gemma 2 is tied) and has no query_pre_attn_scalar key:
# the tied layouts with the scalar at head_dim
GGUF_LAYOUTS = ["gqa-tied-window8", "mqa-tied-head_dim32-window6",
                "gqa-full-then-sliding-3-layers"]  # fmt: skip


@pytest.mark.parametrize("name", GGUF_LAYOUTS)
def test_a_gguf_of_the_same_weights_gives_transformers_logits(name):
    """gemma2 GGUF: the caps, the window, norms stored as 1 + w, llama.cpp's period-2 layer
    pattern (per-layer flags written where the layers differ from it)."""
    check_gguf(LAYOUTS[name], PROMPT)


def test_llama_cpp_reads_the_test_gguf_as_transformers_does():
    check_llama_cpp(LAYOUTS["gqa-tied-window8"], PROMPT)


def test_fused_cpu_step_names_what_it_cannot_express():
    from engine_proc.executor.fused_decode import architecture_unsupported_reason

    why = architecture_unsupported_reason(engine_for(LAYOUTS["gqa-tied-window8"]).model_config)
    assert why is not None
    assert "attention logit soft-capping" in why and "final logit soft-capping" in why


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_soft_capping_and_windows_run_on_the_triton_kernels():
    """The Triton kernel computes soft-capped scores and sliding windows: 'auto' takes it on
    CUDA and gives transformers' logits (the interpreter runs the same kernel on CPU in
    tests/engine_proc/attention/test_triton_engine.py)."""
    layout = LAYOUTS["gqa-tied-window8"]
    engine = engine_for(layout, device="cuda", attention_backend="auto")
    assert engine.backend.name == "triton"
    ours = all_position_logits(engine, PROMPT).cpu()
    torch.testing.assert_close(ours, reference_logits(layout, PROMPT), atol=1e-4, rtol=1e-4)
