"""Phi-3 / Phi-4 (Phi3ForCausalLM) against transformers' float32 forward and generate() on tiny
random checkpoints (tests/tiny_models.py): fused qkv_proj / gate_up_proj split at load, GQA,
MQA, MHA, tied and untied, a sliding window shorter than the prompt, LongRoPE and partial
rotary (Phi-4-mini's layout); block sizes 16 and 7, the prefix cache's second pass, preemption,
and the GGUF of the same weights as llama.cpp's converter writes it.

Phi-3 has no head_dim of its own (always hidden / heads), so no layout varies it.

LongRoPE: the tiny models' original_max_position_embeddings is 32. Our rotary tables pick the
factors by a token's own position (short below 32, long from 32 on; see RotaryEmbedding), so a
token's K never changes once cached. transformers picks one set for the whole sequence: a
forward call whose largest position + 1 exceeds 32 rotates every token with the long factors,
and Phi-3's generate() (prepare_inputs_for_generation) drops its cache at the step that reaches
33 tokens and encodes the whole sequence again with them. So:
- sequences that stay within 32 tokens (prompt and reply): logits and generate()'s tokens
  match exactly (test_logits_and_greedy_tokens_match_transformers, 18 + 12 tokens);
- past 32 tokens, ours equals transformers called one token at a time on its own cache (no
  generate() reset), which applies the same per-position rule; transformers' one-call forward
  of a longer prompt and generate() crossing 32 differ from it, and the tests below assert that
  they do (test_past_the_original_length_*)."""

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
    reference_logits,
)
from tests.engine_proc.models.test_llama import all_position_logits

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
SHORT_PROMPT = PROMPT[:18]  # + 12 new tokens: within the original 32
CROSSING_PROMPT = PROMPT[:25]  # + 12 new tokens: generation crosses position 32


def _prompt(name: str) -> list[int]:
    return SHORT_PROMPT if "longrope" in name else PROMPT


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


def _stepwise(layout, prompt: list[int], first: int, new_tokens: int = 0):
    """transformers fed prompt[:first] in one call, then one token per call on its own cache
    (the rest of the prompt, then its greedy choices): logits of every prompt position and the
    new tokens."""
    model = reference(layout)
    with torch.no_grad():
        out = model(torch.tensor([prompt[:first]]), use_cache=True)
        rows, cache = [out.logits[0]], out.past_key_values
        for token in prompt[first:]:
            out = model(torch.tensor([[token]]), cache=cache, use_cache=True)
            rows.append(out.logits[0])
            cache = out.past_key_values
        tokens = [int(rows[-1][-1].argmax())]
        while len(tokens) < new_tokens:
            out = model(torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
            cache = out.past_key_values
            tokens.append(int(out.logits[0, -1].argmax()))
    return torch.cat(rows).float(), tokens[:new_tokens]


@pytest.mark.parametrize("name", ["gqa-longrope", "partial-longrope-tied"])
def test_past_the_original_length_a_long_prompt(name):
    """45 tokens: ours equals transformers fed token by token from position 32 on; its one-call
    forward (long factors at every position) differs."""
    layout = LAYOUTS[name]
    ours = all_position_logits(engine_for(layout, 7), PROMPT)
    stepwise, _ = _stepwise(layout, PROMPT, ORIGINAL)
    torch.testing.assert_close(ours, stepwise, atol=1e-4, rtol=1e-4)
    assert (reference_logits(layout, PROMPT) - stepwise).abs().max() > 1e-2


def test_past_the_original_length_a_reply_crossing_it():
    """25 + 12 tokens: greedy tokens equal transformers' own step-by-step decode; generate()
    (which re-encodes the sequence with the long factors at 33 tokens) chooses others."""
    layout = LAYOUTS["gqa-longrope"]
    (ours,) = engine_for(layout).generate([CROSSING_PROMPT], GREEDY)
    _, tokens = _stepwise(layout, CROSSING_PROMPT, len(CROSSING_PROMPT) - 1, NEW_TOKENS)
    assert ours.token_ids == tokens
    assert reference_greedy(layout, CROSSING_PROMPT) != tokens


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
