"""Phi-3 / Phi-4 (Phi3ForCausalLM) against transformers' float32 forward and generate() on tiny
random checkpoints (tests/tiny_models/): fused qkv_proj / gate_up_proj split at load, GQA,
MQA, MHA, tied and untied, a sliding window shorter than the prompt, LongRoPE and partial
rotary (Phi-4-mini's layout); block sizes 16 and 7, the prefix cache's second pass, preemption,
and the GGUF of the same weights as llama.cpp's converter writes it.

Phi-3 has no head_dim of its own (always hidden / heads), so no layout varies it.

LongRoPE: the tiny models' original_max_position_embeddings is 32, so the 45-token prompt is
past it (transformers' forward rotates every position with the long factors; so do we), an
18-token prompt with its 12 new tokens stays within it (short factors), and a 25- or 32-token
prompt grows past it while decoding (Phi-3's generate() then re-encodes the sequence with the
long factors; the scheduler recomputes it)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.engine_proc.models.family_checks import (
    GREEDY,
    NEW_TOKENS,
    PROMPT,
    check_gguf,
    check_llama_cpp,
    check_logits_and_greedy,
    check_preemption,
    engine_for,
    reference,
    reference_greedy,
)

LAYOUTS = {
    "gqa-untied": ("phi3", dict(num_heads=4, num_kv_heads=2)),
    "mqa-tied-window8": ("phi3", dict(num_heads=4, num_kv_heads=1, tie_word_embeddings=True,
                                      sliding_window=8)),
    "mha-window5": ("phi3", dict(num_heads=4, num_kv_heads=4, sliding_window=5)),
    "gqa-longrope": ("phi3", dict(num_kv_heads=2, rope_scaling="longrope")),
    # Phi-4-mini: 3/4 of each head rotated, LongRoPE, tied embeddings
    "partial-longrope-tied": ("phi3", dict(num_kv_heads=1, rope_scaling="longrope",
                                           partial_rotary_factor=0.75, tie_word_embeddings=True)),
    "partial-half": ("phi3", dict(num_kv_heads=2, partial_rotary_factor=0.5)),
}  # fmt: skip
ORIGINAL = 32  # tiny_models.phi3_longrope's original_max_position_embeddings


def _prompt(name: str) -> list[int]:
    return PROMPT


CASES = [(name, 16) for name in LAYOUTS] + [("mqa-tied-window8", 7), ("partial-longrope-tied", 7)]


@pytest.mark.parametrize(("name", "block_size"), CASES, ids=[f"{n}-bs{b}" for n, b in CASES])
def test_logits_and_greedy_tokens_match_transformers(name, block_size):
    engine = check_logits_and_greedy(LAYOUTS[name], block_size, _prompt(name))
    c = engine.model_config
    assert c.architecture == "Phi3ForCausalLM" and c.head_dim == 16
    params = LAYOUTS[name][1]
    assert c.sliding_window == params.get("sliding_window")
    assert c.rotary_dim == {0.75: 12, 0.5: 8}.get(params.get("partial_rotary_factor"))
    assert (c.rope_scaling is not None) == ("rope_scaling" in params)


def test_longrope_config_follows_transformers():
    c = engine_for(LAYOUTS["partial-longrope-tied"]).model_config
    scaling = c.rope_scaling
    assert scaling["rope_type"] == "longrope" and scaling["original_max_position_embeddings"] == 32
    assert len(scaling["short_factor"]) == len(scaling["long_factor"]) == 6  # rotary 12 / 2
    rotary = reference(LAYOUTS["partial-longrope-tied"]).model.rotary_emb
    assert scaling["attention_factor"] == pytest.approx(rotary.attention_scaling, rel=1e-7)
    # factor 512 / 32 = 16 (max_position_embeddings / original): sqrt(1 + ln 16 / ln 32)
    assert scaling["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(16) / math.log(32)))


@pytest.mark.parametrize("name", ["gqa-longrope", "partial-longrope-tied"])
@pytest.mark.parametrize("length", [18, 25, ORIGINAL])
def test_longrope_replies_within_and_across_the_original_length(name, length):
    """18 + 12 tokens stay within 32; 25 + 12 and 32 + 12 grow past it while decoding: the
    sequence is recomputed once under the long factors, and generate()'s tokens come out."""
    layout = LAYOUTS[name]
    prompt = PROMPT[:length]
    check_logits_and_greedy(layout, 7, prompt)
    engine = engine_for(layout, enable_prefix_caching=False)
    (out,) = engine.generate([prompt], GREEDY)
    assert out.token_ids == reference_greedy(layout, prompt)
    assert engine.stats.num_preemptions == (0 if length + NEW_TOKENS <= ORIGINAL else 1)


@pytest.mark.parametrize("name", ["mqa-tied-window8", "partial-longrope-tied"])
def test_preemption_under_a_small_pool_changes_no_token(name):
    check_preemption(LAYOUTS[name])


GGUF_LAYOUTS = ["gqa-untied", "mqa-tied-window8", "partial-longrope-tied"]


@pytest.mark.parametrize("name", GGUF_LAYOUTS)
def test_a_gguf_of_the_same_weights_gives_transformers_logits(name):
    """llama.cpp's phi3 layout: attn_qkv and ffn_up (gate and up) fused, rope_factors_long /
    _short, rope.scaling.attn_factor / original_context_length, rope.dimension_count."""
    check_gguf(LAYOUTS[name], _prompt(name))


def test_llama_cpp_reads_the_test_gguf_as_transformers_does():
    """Without window or LongRoPE: llama.cpp turns Phi-3's window off and picks LongRoPE factors
    by its context size, so only the plain layout is comparable."""
    check_llama_cpp(LAYOUTS["gqa-untied"], PROMPT)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}},
         r"rope_type='yarn' is not supported for Phi3ForCausalLM \(default, longrope\)"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                              "partial_rotary_factor": 0.1}},
         r"partial_rotary_factor=0.1"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0],
                              "long_factor": [1.0], "original_max_position_embeddings": 32}},
         r"longrope short_factor has 1 entries, expected 8"),
    ],
)  # fmt: skip
def test_bad_phi3_configs_are_refused_by_name(tmp_path, change, message):
    import json
    import shutil

    from engine_proc.loading.loader import load_checkpoint
    from tests.tiny_models import tiny_model_dir

    dst = tmp_path / "bad"
    shutil.copytree(tiny_model_dir("phi3"), dst)
    config = json.loads((dst / "config.json").read_text()) | change
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        load_checkpoint(str(dst), torch.float32)


def test_fused_cpu_step_names_what_it_cannot_express():
    from engine_proc.executor.fused_decode import architecture_unsupported_reason

    why = architecture_unsupported_reason(engine_for(LAYOUTS["partial-longrope-tied"]).model_config)
    assert why is not None and "partial rotary" in why and "longrope" in why
    plain = architecture_unsupported_reason(engine_for(LAYOUTS["gqa-untied"]).model_config)
    assert plain == "has not been run on Phi3ForCausalLM by any test yet"
