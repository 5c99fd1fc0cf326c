"""The families beyond Llama (Qwen3, Mistral with its sliding window, Qwen3 with sliding layers,
Gemma 3) against transformers' own float32 forward and generate(), on tiny random checkpoints:
logits at every position of prompts longer than the windows, through chunked prefill and the
paged cache at block sizes 16 and 7, greedy tokens, a second pass from the prefix cache, and
preemption under a small pool."""

from __future__ import annotations

import functools

import pytest
import torch

from engine_proc import EngineConfig, LLMEngine, SamplingParams
from tests.engine_proc.models.family_checks import check_preemption_with
from tests.engine_proc.models.test_llama import all_position_logits
from tests.tiny_models import hf_reference_model, tiny_model_dir

SLIDING, FULL = "sliding_attention", "full_attention"
# (architecture, tiny_model_dir parameters); every one with a window shorter than the prompt
LAYOUTS = {
    "qwen3-gqa-head_dim32": ("qwen3", dict(num_heads=4, num_kv_heads=2, head_dim=32)),
    "qwen3-mqa-tied": ("qwen3", dict(num_heads=4, num_kv_heads=1, tie_word_embeddings=True)),
    "qwen3-sliding-then-full": ("qwen3", dict(sliding_window=8, layer_types=(SLIDING, FULL))),
    "mistral-mha-window8": ("mistral", dict(num_heads=4, num_kv_heads=4, sliding_window=8)),
    "mistral-gqa-window5": ("mistral", dict(num_heads=4, num_kv_heads=2, sliding_window=5)),
    "gemma3-gqa-window8": ("gemma3", dict(num_heads=4, num_kv_heads=2, sliding_window=8)),
    "gemma3-mqa-head_dim32-window6": (
        "gemma3", dict(num_heads=4, num_kv_heads=1, head_dim=32, sliding_window=6,
                       tie_word_embeddings=False)),
    "gemma3-query_pre_attn_scalar": ("gemma3", dict(sliding_window=8, query_pre_attn_scalar=64)),
}  # fmt: skip
PROMPT = torch.randint(3, 49152, (45,), generator=torch.Generator().manual_seed(1)).tolist()
NEW_TOKENS = 12


def _path(name: str):
    arch, params = LAYOUTS[name]
    return tiny_model_dir(arch, **params)


def _engine(name: str, block_size: int = 16, **overrides) -> LLMEngine:
    config = dict(model=str(_path(name)), block_size=block_size, num_kv_blocks=200,
                  long_prefill_chunk=11)  # fmt: skip
    return LLMEngine(EngineConfig(**(config | overrides)))


def _reference_greedy(name: str, prompt: list[int]) -> list[int]:
    model = hf_reference_model(_path(name))
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long), eos_token_id=None,
        pad_token_id=0,
    )  # fmt: skip
    return out[0, len(prompt) :].tolist()


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
CASES = [(name, 16) for name in LAYOUTS] + [
    ("qwen3-gqa-head_dim32", 7), ("mistral-gqa-window5", 7), ("gemma3-gqa-window8", 7)]


@pytest.mark.parametrize(("name", "block_size"), CASES, ids=[f"{n}-bs{b}" for n, b in CASES])
def test_logits_and_greedy_tokens_match_transformers(name, block_size):
    engine = _engine(name, block_size)
    config = engine.model_config
    assert config.architecture == {"qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM",
                                   "gemma3": "Gemma3ForCausalLM"}[LAYOUTS[name][0]]  # fmt: skip
    window = LAYOUTS[name][1].get("sliding_window")
    assert config.sliding_window == window and (window is None or window < len(PROMPT))
    ours = all_position_logits(engine, PROMPT)
    with torch.no_grad():
        ref = hf_reference_model(_path(name))(torch.tensor([PROMPT])).logits[0].float()
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)

    ref_ids = _reference_greedy(name, PROMPT)
    (cold,) = engine.generate([PROMPT], GREEDY)
    assert cold.token_ids == ref_ids
    # the same prompt again: its full blocks come from the prefix cache, the reply is the same
    (warm,) = engine.generate([PROMPT], GREEDY)
    assert warm.num_cached_tokens >= len(PROMPT) // block_size * block_size - block_size
    assert warm.num_cached_tokens > 0 and warm.token_ids == ref_ids
    assert engine.kv.pool.num_free == engine.num_blocks


@pytest.mark.parametrize("name", ["mistral-gqa-window5", "gemma3-gqa-window8"])
def test_preemption_under_a_small_pool_changes_no_token(name):
    check_preemption_with(functools.partial(_engine, name))


def test_gemma3_folds_its_one_plus_weight_norms_and_scales():
    engine = _engine("gemma3-gqa-window8")
    c = engine.model_config
    assert c.qk_norm and c.sandwich_norms and c.hidden_act == "gelu_tanh"
    assert c.layer_types == (SLIDING, FULL) and c.rope_local_theta == 1000.0
    assert c.embed_scale == pytest.approx(64**0.5) and c.query_scale == pytest.approx(16**-0.5)
    scaled = _engine("gemma3-query_pre_attn_scalar").model_config
    assert scaled.query_scale == pytest.approx(64**-0.5)
    ref = hf_reference_model(_path("gemma3-gqa-window8"))
    stored = ref.model.layers[0].input_layernorm.weight
    torch.testing.assert_close(engine.model.layers[0].input_norm, stored + 1.0)


def test_fused_cpu_step_names_what_it_cannot_express():
    import dataclasses

    from engine_proc.executor.fused_decode import architecture_unsupported_reason

    qwen3 = _engine("qwen3-mqa-tied").model_config
    gemma3 = _engine("gemma3-gqa-window8").model_config
    # both run fused now (tests/engine_proc/executor/test_fused_families.py)
    assert architecture_unsupported_reason(qwen3) is None
    assert architecture_unsupported_reason(gemma3) is None
    capped = dataclasses.replace(gemma3, attn_logit_softcap=50.0, final_logit_softcap=30.0)
    assert architecture_unsupported_reason(capped) == (
        "has no attention logit soft-capping, final logit soft-capping (Gemma3ForCausalLM)")


GGUF_LAYOUTS = ["qwen3-gqa-head_dim32", "qwen3-mqa-tied", "gemma3-gqa-window8",
                "gemma3-mqa-head_dim32-window6"]  # fmt: skip


@pytest.mark.parametrize("name", GGUF_LAYOUTS)
def test_a_gguf_of_the_same_weights_gives_transformers_logits(name):
    """llama.cpp's layout (tests/tiny_models/ writes it as convert_hf_to_gguf.py does: Gemma's
    norms as 1 + w, q/k norm tensors, the window, the local rotary base, the layer pattern)."""
    from tests.tiny_models import tiny_gguf_file

    arch, params = LAYOUTS[name]
    engine = LLMEngine(EngineConfig(model=str(tiny_gguf_file(arch, **params)), num_kv_blocks=64,
                                    long_prefill_chunk=11))  # fmt: skip
    from_dir = _engine(name).model_config
    assert engine.model_config == from_dir  # every field, read from the GGUF's metadata
    ours = all_position_logits(engine, PROMPT)
    with torch.no_grad():
        ref = hf_reference_model(_path(name))(torch.tensor([PROMPT])).logits[0].float()
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["qwen3-gqa-head_dim32", "gemma3-gqa-window8"])
def test_llama_cpp_reads_the_test_gguf_as_transformers_does(name):
    """The GGUF writer checked by a reader we did not write: llama.cpp's own forward on it gives
    transformers' logits (optional: needs llama-cpp-python)."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from tests.tiny_models import tiny_gguf_file

    arch, params = LAYOUTS[name]
    f32 = 0  # GGML_TYPE_F32: a float32 KV cache (llama.cpp's default is f16)
    llm = llama_cpp.Llama(str(tiny_gguf_file(arch, **params)), n_ctx=128, logits_all=True,
                          verbose=False, n_threads=2, type_k=f32, type_v=f32)  # fmt: skip
    llm.eval(PROMPT)
    theirs = torch.tensor(llm.scores[: len(PROMPT)], dtype=torch.float32)
    with torch.no_grad():
        ref = hf_reference_model(_path(name))(torch.tensor([PROMPT])).logits[0].float()
    # llama.cpp's kernels round some products through f16 (seen: 3.5e-3 on logits of std ~3; a
    # misread tensor or key moves them by whole units)
    torch.testing.assert_close(theirs, ref, atol=1e-2, rtol=1e-3)
    assert torch.equal(theirs.argmax(-1), ref.argmax(-1))
