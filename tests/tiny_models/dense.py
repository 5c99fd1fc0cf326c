"""Tiny random dense checkpoints (Llama, Qwen2, Qwen3, Mistral, Gemma 3, and Phi-3 / Gemma 2 through
phi_gemma2.py) as HF directories, and the transformers reference model of one."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import torch

from tests.tiny_models.phi_gemma2 import (
    PHI_GEMMA2_ARCHITECTURES,
    _phi_gemma2_config,
    _validate_phi_gemma2,
)
from tests.tiny_models.session import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    TOKENIZER_VOCAB_SIZE,
    _cache,
    _session_dir,
    save_to_cache,
)

ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "gemma3") + PHI_GEMMA2_ARCHITECTURES
LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # small, so the scaling changes some frequencies of a 16-dim head at short positions
    "original_max_position_embeddings": 64,
}


def tiny_model_dir(
    architecture: str = "llama",
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    attention_bias: bool | None = None,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 512,
    rope_theta: float = 10000.0,
    rope_scaling: str | dict | None = None,
    sliding_window: int | None = None,
    layer_types: tuple[str, ...] | None = None,
    query_pre_attn_scalar: int | None = None,
    seed: int = 0,
    partial_rotary_factor: float = 1.0,
    softcapping: tuple[float | None, float | None] = (2.0, 5.0),
) -> Path:
    """Build (once per parameter set and session) a tiny HF checkpoint directory; return its path.

    num_kv_heads == num_heads is MHA, 1 is MQA, anything between is GQA. attention_bias
    defaults to the architecture's own (Qwen2: q/k/v biases, Llama: none). rope_scaling: None,
    "llama3" (LLAMA3_ROPE_SCALING) or an HF-style dict. sliding_window: on every layer (mistral;
    qwen2/qwen3 turn on use_sliding_window) or on the sliding ones of `layer_types` (gemma3, whose
    default is sliding then full, alternating; and qwen2/qwen3). query_pre_attn_scalar: gemma3's
    (default head_dim, as the released models but the 27B; GGUF has no key for it).
    phi3 / gemma2: see _phi_gemma2_config (rope_scaling "longrope", partial_rotary_factor,
    softcapping = (attention, final) caps, small so that they bend the tiny model's values).
    """
    params = dict(locals())
    key = json.dumps(params, sort_keys=True)
    if key in _cache:
        return _cache[key]
    _validate(architecture, num_heads, num_kv_heads, attention_bias, rope_scaling)
    config = _hf_config(**params)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config)
    _randomize(model, seed)
    return save_to_cache(model, "model", key)


def with_chat_template(model_dir: Path, template: str, name: str) -> Path:
    """A copy of a tiny checkpoint directory under another chat template (e.g. one with thinking
    markers or tool support); built once per name and session."""
    key = f"template:{name}"
    if key not in _cache:
        out = _session_dir() / f"templated-{name}"
        shutil.copytree(model_dir, out)
        (out / "chat_template.jinja").write_text(template)
        config = json.loads((out / "tokenizer_config.json").read_text())
        config.pop("chat_template", None)  # the .jinja file is the template
        (out / "tokenizer_config.json").write_text(json.dumps(config))
        _cache[key] = out
    return _cache[key]


def hf_reference_model(path: str | Path, dtype: torch.dtype = torch.float32) -> Any:
    """The transformers model of a checkpoint directory, in eval mode (eager attention)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=dtype, attn_implementation="eager"
    )
    return model.eval()


# --------------------------------------------------------------------------------------------


def _validate(
    architecture: str,
    num_heads: int,
    num_kv_heads: int,
    attention_bias: bool | None,
    rope_scaling: str | dict | None,
) -> None:
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {ARCHITECTURES}, got {architecture!r}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads")
    if architecture in ("qwen3", "mistral", "gemma3") and attention_bias:
        raise ValueError(f"{architecture} has no q/k/v biases the engine runs (only qwen2's)")
    if architecture == "qwen2" and attention_bias is False:
        raise ValueError("qwen2 always has q/k/v biases: attention_bias must be None or True")
    if architecture == "llama" and attention_bias:
        raise ValueError(
            "llama's attention_bias also biases o_proj, which the engine does not support; "
            "use architecture='qwen2' for q/k/v biases"
        )
    if architecture in PHI_GEMMA2_ARCHITECTURES:
        _validate_phi_gemma2(architecture, attention_bias, rope_scaling)
        return
    if rope_scaling is not None and rope_scaling != "llama3" and not isinstance(rope_scaling, dict):
        raise ValueError(f"rope_scaling must be None, 'llama3' or a dict, got {rope_scaling!r}")


def _hf_config(
    architecture: str,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    hidden_size: int,
    intermediate_size: int,
    num_layers: int,
    attention_bias: bool | None,
    tie_word_embeddings: bool,
    max_position_embeddings: int,
    rope_theta: float,
    rope_scaling: str | dict | None,
    sliding_window: int | None,
    layer_types: tuple[str, ...] | None,
    query_pre_attn_scalar: int | None,
    seed: int,
    partial_rotary_factor: float,
    softcapping: tuple[float | None, float | None],
) -> Any:
    from transformers import (
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
        Qwen3Config,
    )

    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": rope_theta}
    if rope_scaling is not None and rope_scaling != "longrope":  # phi3's: _phi_gemma2_config
        scaling = LLAMA3_ROPE_SCALING if rope_scaling == "llama3" else rope_scaling
        rope = {**scaling, "rope_theta": rope_theta}
    common = dict(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        rope_parameters=rope,
    )
    if architecture in PHI_GEMMA2_ARCHITECTURES:
        return _phi_gemma2_config(architecture, common, rope_theta, rope_scaling, sliding_window,
                                  layer_types, query_pre_attn_scalar, partial_rotary_factor,
                                  softcapping)  # fmt: skip
    window = {"use_sliding_window": sliding_window is not None, "sliding_window": sliding_window}
    if layer_types is not None:
        window["layer_types"] = list(layer_types)
    if architecture == "llama":
        config = LlamaConfig(attention_bias=False, **common)
    elif architecture == "qwen2":
        config = Qwen2Config(**window, **common)
    elif architecture == "qwen3":
        config = Qwen3Config(attention_bias=False, **window, **common)
    elif architecture == "mistral":
        config = MistralConfig(sliding_window=sliding_window, **common)
    else:
        types = layer_types or tuple("full_attention" if i % 2 else "sliding_attention"
                                     for i in range(num_layers))  # fmt: skip
        common["rope_parameters"] = {"full_attention": rope,
                                     "sliding_attention": {"rope_type": "default",
                                                           "rope_theta": rope_theta / 10}}
        config = Gemma3TextConfig(sliding_window=sliding_window or 4096, layer_types=list(types),
                                  query_pre_attn_scalar=query_pre_attn_scalar or head_dim,
                                  hidden_activation="gelu_pytorch_tanh",
                                  pad_token_id=0, **common)  # fmt: skip
    names = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
             "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM",
             "gemma3": "Gemma3ForCausalLM"}  # fmt: skip
    config.architectures = [names[architecture]]
    return config


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.named_parameters()):
        shape = param.shape
        if name.endswith("norm.weight"):
            value = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith(".bias"):
            value = 0.5 * torch.randn(shape, generator=gen)
        elif "embed_tokens" in name:
            value = torch.randn(shape, generator=gen)
        else:
            # q/k larger than 1/sqrt(fan_in): attention scores with std ~2, not near uniform;
            # lm_head larger: logits with std ~3, so greedy choices are not near-ties.
            scale = 1.5 if ("q_proj" in name or "k_proj" in name or "qkv_proj" in name) else 1.0
            scale = 3.0 if name == "lm_head.weight" else scale
            value = torch.randn(shape, generator=gen) * (scale / math.sqrt(shape[1]))
        param.copy_(value)
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
