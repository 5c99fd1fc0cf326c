"""Tiny random Llama / Qwen2 checkpoints for tests, built with transformers and cached per session.

    from tests.tiny_models import tiny_model_dir, tiny_gguf_file, hf_reference_model

    path = tiny_model_dir("qwen2", num_heads=4, num_kv_heads=1)   # HF dir: config + safetensors
    ref = hf_reference_model(path)                               # transformers model, eval mode
    gguf_path = tiny_gguf_file("llama")                          # same weights as a llama.cpp GGUF

Every model uses the default SmolLM2 tokenizer (vocab 49152, chat template, bos 1, eos 2), so
prompts and chat messages work as with the real model; hidden size 64 and 2 layers keep each
checkpoint at a few MB. Weights are seeded and scaled so attention is far from uniform (a
bug in positions or masking changes the logits) and greedy next tokens are well separated.
"""

from __future__ import annotations

import atexit
import json
import math
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

TOKENIZER_VOCAB_SIZE = 49152
BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2
PHI_GEMMA2_ARCHITECTURES = ("phi3", "gemma2")  # built by _phi_gemma2_config below
ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "gemma3") + PHI_GEMMA2_ARCHITECTURES
LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # small, so the scaling changes some frequencies of a 16-dim head at short positions
    "original_max_position_embeddings": 64,
}

_root: Path | None = None
_cache: dict[str, Path] = {}


def _session_dir() -> Path:
    global _root
    if _root is None:
        _root = Path(tempfile.mkdtemp(prefix="kvscope-tiny-models-"))
        atexit.register(shutil.rmtree, _root, ignore_errors=True)
    return _root


def tiny_tokenizer_dir() -> Path:
    """A directory holding the default model's tokenizer, saved with save_pretrained."""
    if "tokenizer" not in _cache:
        from transformers import PreTrainedTokenizerFast

        from engine_proc.loading.loader import default_model_path

        gguf_path = default_model_path()
        tokenizer = PreTrainedTokenizerFast.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name
        )
        assert tokenizer.chat_template, "the default GGUF should carry a chat template"
        assert len(tokenizer) == TOKENIZER_VOCAB_SIZE, len(tokenizer)
        out = _session_dir() / "tokenizer"
        tokenizer.save_pretrained(str(out))
        _cache["tokenizer"] = out
    return _cache["tokenizer"]


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
    out = _session_dir() / f"model-{len(_cache)}"
    model.save_pretrained(str(out))
    for item in tiny_tokenizer_dir().iterdir():
        shutil.copy(item, out / item.name)
    _cache[key] = out
    return out


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


def tiny_gguf_file(architecture: str = "llama", **params: Any) -> Path:
    """The tiny_model_dir(architecture, **params) weights written as llama.cpp would: float32
    GGUF, llama.cpp tensor names, q/k rows permuted for llama, rope_freqs for llama3 scaling,
    the tokenizer's vocabulary and chat template in the metadata."""
    hf_dir = tiny_model_dir(architecture, **params)
    key = f"gguf:{hf_dir}"
    if key not in _cache:
        out = hf_dir.parent / f"{hf_dir.name}.gguf"
        _write_gguf(hf_dir, out)
        _cache[key] = out
    return _cache[key]


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


# --------------------------------------------------------------------------------------------
# GGUF writer (what llama.cpp's convert_hf_to_gguf.py does for these architectures)

_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
# Gemma 3 (llama.cpp conversion/gemma.py): the sandwich norms, and ffn_norm is the pre-MLP one
_GGUF_GEMMA3_LAYER = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
_GGUF_QK_NORM = {
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}
_GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
              "gemma3_text": "gemma3"}  # fmt: skip
_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def _llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute (n_head already the kv count for k)."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _llama_cpp_rope_freqs(scaling: dict, theta: float, head_dim: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.generate_extra_tensors (Llama 3 rope)."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    base_freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factors = []
    for freq in base_freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            factors.append(1)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _write_gguf(hf_dir: Path, out: Path) -> None:
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    if config["model_type"] in PHI_GEMMA2_ARCHITECTURES:
        _write_gguf_phi_gemma2(hf_dir, out, config)
        return
    arch = (_GGUF_ARCH | _GGUF_MOE_ARCH)[config["model_type"]]
    tensors = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config["head_dim"]
    rope = config["rope_parameters"]
    if arch == "gemma3":
        rope = rope["full_attention"]
    if arch == "llama" and config.get("sliding_window"):
        raise ValueError("llama.cpp keeps no sliding window for Mistral: write it without one")

    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(f"tiny-{config['model_type']}")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if arch == "gemma3":
        # the window, the local base (conversion/base.py add_rope_freq_base_swa) and, since the
        # tiny models alternate instead of llama.cpp's default of one global layer in six, the
        # per-layer flags llama.cpp's load_swa_pattern reads
        writer.add_sliding_window(config["sliding_window"])
        writer.add_rope_freq_base_swa(config["rope_parameters"]["sliding_attention"]["rope_theta"])
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in config["layer_types"]])
    if config["model_type"] in _GGUF_MOE_ARCH:
        tensors = _moe_gguf_metadata_and_tensors(writer, config, tensors)
    _add_tokenizer(writer, hf_dir)

    if rope.get("rope_type") == "llama3":
        freqs = _llama_cpp_rope_freqs(rope, rope["rope_theta"], head_dim)
        writer.add_tensor("rope_freqs.weight", freqs)
    layer_names = _GGUF_LAYER | _GGUF_QK_NORM | (_GGUF_GEMMA3_LAYER if arch == "gemma3" else {})
    layer_names |= _GGUF_MOE_LAYER
    for name, value in tensors.items():
        if config["tie_word_embeddings"] and name == "lm_head.weight":
            continue
        if name in _GGUF_GLOBAL:
            gguf_name = _GGUF_GLOBAL[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            gguf_name = f"blk.{layer}.{layer_names[rest]}"
        value = np.ascontiguousarray(value, dtype=np.float32)
        if arch == "gemma3" and name.endswith("norm.weight"):
            value = value + np.float32(1.0)  # Gemma3Model.norm_shift: llama.cpp stores 1 + w
        if arch == "llama" and ".attn_q." in gguf_name:
            value = _llama_cpp_permute(value, heads)
        elif arch == "llama" and ".attn_k." in gguf_name:
            value = _llama_cpp_permute(value, kv_heads)
        writer.add_tensor(gguf_name, np.ascontiguousarray(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_tokenizer(writer: Any, tokenizer_dir: Path) -> None:
    """GPT-2-style BPE vocabulary, as llama.cpp's converter stores it."""
    import gguf

    data = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = data["model"]["vocab"]
    tokens = [""] * TOKENIZER_VOCAB_SIZE
    for token, index in vocab.items():
        tokens[index] = token
    special = {t["id"] for t in data.get("added_tokens", []) if t.get("special")}
    for t in data.get("added_tokens", []):
        tokens[t["id"]] = t["content"]
    types = [
        gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
        for i in range(len(tokens))
    ]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(BOS_TOKEN_ID)
    writer.add_eos_token_id(EOS_TOKEN_ID)
    writer.add_add_bos_token(False)
    template = (tokenizer_dir / "chat_template.jinja").read_text()
    writer.add_chat_template(template)


# --------------------------------------------------------------------------------------------
# Routed-experts models (Qwen3-MoE, Mixtral): their own builder and GGUF pieces

MOE_ARCHITECTURES = ("qwen3_moe", "mixtral")
_GGUF_MOE_ARCH = {"qwen3_moe": "qwen3moe", "mixtral": "llama"}
# stacked expert tensors (named by _stack_experts_for_gguf) -> llama.cpp's names
_GGUF_MOE_LAYER = {
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.gate_proj": "ffn_gate_exps.weight",
    "mlp.experts.up_proj": "ffn_up_exps.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
}


def tiny_moe_model_dir(
    architecture: str = "qwen3_moe",
    *,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int = 48,
    norm_topk_prob: bool = True,
    decoder_sparse_step: int = 1,
    mlp_only_layers: tuple[int, ...] = (),
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    hidden_size: int = 64,
    intermediate_size: int = 96,
    num_layers: int = 2,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 512,
    rope_theta: float = 10000.0,
    sliding_window: int | None = None,
    seed: int = 0,
) -> Path:
    """A tiny Qwen3-MoE or Mixtral checkpoint directory (transformers' save_pretrained: one
    tensor per expert), built once per parameter set and session. Qwen3-MoE: experts
    moe_intermediate_size wide, dense MLPs (intermediate_size) in mlp_only_layers and where
    decoder_sparse_step skips; Mixtral: experts intermediate_size wide, always renormalised
    (norm_topk_prob, moe_intermediate_size, decoder_sparse_step and mlp_only_layers unused)."""
    params = dict(locals())
    key = "moe:" + json.dumps(params, sort_keys=True)
    if key in _cache:
        return _cache[key]
    if architecture not in MOE_ARCHITECTURES:
        raise ValueError(f"architecture must be one of {MOE_ARCHITECTURES}, got {architecture!r}")
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

    common = dict(
        vocab_size=TOKENIZER_VOCAB_SIZE, hidden_size=hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, head_dim=head_dim,
        max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-5,
        tie_word_embeddings=tie_word_embeddings, bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID, num_experts_per_tok=num_experts_per_tok,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
    )  # fmt: skip
    if architecture == "qwen3_moe":
        config = Qwen3MoeConfig(
            intermediate_size=intermediate_size, moe_intermediate_size=moe_intermediate_size,
            num_experts=num_experts, norm_topk_prob=norm_topk_prob,
            decoder_sparse_step=decoder_sparse_step, mlp_only_layers=list(mlp_only_layers),
            use_sliding_window=sliding_window is not None, sliding_window=sliding_window,
            attention_bias=False, **common)  # fmt: skip
        config.architectures = ["Qwen3MoeForCausalLM"]
    else:
        config = MixtralConfig(intermediate_size=intermediate_size, num_local_experts=num_experts,
                               sliding_window=sliding_window, **common)  # fmt: skip
        config.architectures = ["MixtralForCausalLM"]
    model = AutoModelForCausalLM.from_config(config)
    _randomize(model, seed)
    _randomize_experts(model, seed)
    out = _session_dir() / f"moe-model-{len(_cache)}"
    model.save_pretrained(str(out))
    for item in tiny_tokenizer_dir().iterdir():
        shutil.copy(item, out / item.name)
    _cache[key] = out
    return out


def tiny_moe_gguf_file(architecture: str = "qwen3_moe", **params: Any) -> Path:
    """tiny_moe_model_dir(architecture, **params) written as llama.cpp's converter writes it:
    experts stacked into ffn_{gate,up,down}_exps, the router as ffn_gate_inp, the expert counts
    in the metadata (Mixtral as `llama`, q/k rows permuted)."""
    hf_dir = tiny_moe_model_dir(architecture, **params)
    key = f"gguf:{hf_dir}"
    if key not in _cache:
        out = hf_dir.parent / f"{hf_dir.name}.gguf"
        _write_gguf(hf_dir, out)
        _cache[key] = out
    return _cache[key]


@torch.no_grad()
def _randomize_experts(model: torch.nn.Module, seed: int) -> None:
    """Stacked expert weights ([experts, out, in]) scaled by their own fan-in (_randomize takes
    shape[1]); routers 3x wider than that, so routing choices are not near-ties."""
    gen = torch.Generator().manual_seed(seed + 1)
    for name, param in sorted(model.named_parameters()):
        if ".experts." in name or name.endswith("mlp.gate.weight"):
            scale = 3.0 if name.endswith("gate.weight") else 1.0
            value = torch.randn(param.shape, generator=gen) * (scale / math.sqrt(param.shape[-1]))
            param.copy_(value)


def _moe_gguf_metadata_and_tensors(writer: Any, config: dict, tensors: dict) -> dict:
    """llama.cpp's expert keys (conversion/base.py, qwen.py Qwen2MoeModel) and its stacked
    tensors (per-expert ones merged with torch.stack over the expert index)."""
    moe_type = config["model_type"]
    experts = config.get("num_experts", config.get("num_local_experts"))
    if moe_type == "qwen3_moe" and not config.get("norm_topk_prob"):
        raise ValueError("llama.cpp renormalises qwen3moe's top-k weights whatever "
                         "norm_topk_prob says: write only norm_topk_prob=True models")  # fmt: skip
    writer.add_expert_count(experts)
    writer.add_expert_used_count(config["num_experts_per_tok"])
    if moe_type == "qwen3_moe":
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    out = {}
    pieces: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    aliases = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    for name, value in tensors.items():
        parts = name.split(".")
        if ".experts." in name:  # model.layers.N.{mlp,block_sparse_moe}.experts.E.P.weight
            layer, expert, proj = parts[2], int(parts[5]), aliases.get(parts[6], parts[6])
            pieces.setdefault((layer, proj), {})[expert] = value
        elif name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
            out[f"model.layers.{parts[2]}.mlp.gate.weight"] = value
        else:
            out[name] = value
    for (layer, proj), by_expert in pieces.items():
        assert sorted(by_expert) == list(range(experts)), (layer, proj, sorted(by_expert))
        stacked = np.stack([by_expert[e] for e in range(experts)])
        out[f"model.layers.{layer}.mlp.experts.{proj}"] = stacked
    return out


# Phi-3 and Gemma 2 (kept apart from the other families' builders)


def phi3_longrope(rotary_dims: int, original: int = 32) -> dict:
    """LongRoPE parameters for a tiny Phi-3: seeded short factors in [1, 2) and long ones in
    [2, 10), one per rotary frequency; a small original length, so a 45-token prompt is long."""
    gen = torch.Generator().manual_seed(7)
    n = rotary_dims // 2
    short = (1.0 + torch.rand(n, generator=gen)).tolist()
    long = (2.0 + 8.0 * torch.rand(n, generator=gen)).tolist()
    return {"rope_type": "longrope", "short_factor": [round(x, 4) for x in short],
            "long_factor": [round(x, 4) for x in long],
            "original_max_position_embeddings": original}  # fmt: skip


def _validate_phi_gemma2(architecture: str, attention_bias: bool | None,
                         rope_scaling: str | dict | None) -> None:  # fmt: skip
    if attention_bias:
        raise ValueError(f"{architecture} has no q/k/v biases")
    allowed = ("longrope",) if architecture == "phi3" else ()
    if rope_scaling is not None and rope_scaling not in allowed and not isinstance(rope_scaling,
                                                                                    dict):
        raise ValueError(f"rope_scaling must be None, a dict or one of {allowed}, got "
                         f"{rope_scaling!r}")  # fmt: skip


def _phi_gemma2_config(
    architecture: str, common: dict, rope_theta: float, rope_scaling: str | dict | None,
    sliding_window: int | None, layer_types: tuple[str, ...] | None,
    query_pre_attn_scalar: int | None, partial_rotary_factor: float,
    softcapping: tuple[float | None, float | None],
) -> Any:  # fmt: skip
    from transformers import Gemma2Config, Phi3Config

    if architecture == "phi3":
        # Phi-3 has no head_dim of its own (hidden / heads); its rope carries the rotary fraction
        head_dim = common.pop("head_dim")
        if head_dim != common["hidden_size"] // common["num_attention_heads"]:
            raise ValueError("phi3's head_dim is hidden_size / num_heads")
        rope: dict[str, Any] = {"rope_type": "default"}
        if rope_scaling == "longrope":
            rope = phi3_longrope(int(head_dim * partial_rotary_factor))
        elif isinstance(rope_scaling, dict):
            rope = dict(rope_scaling)
        rope |= {"rope_theta": rope_theta, "partial_rotary_factor": partial_rotary_factor}
        common["rope_parameters"] = rope
        original = rope.get("original_max_position_embeddings",
                            common["max_position_embeddings"])  # fmt: skip
        config = Phi3Config(sliding_window=sliding_window, pad_token_id=0,
                            original_max_position_embeddings=original, **common)  # fmt: skip
        config.architectures = ["Phi3ForCausalLM"]
        return config
    attn_cap, final_cap = softcapping
    types = layer_types or tuple("full_attention" if i % 2 else "sliding_attention"
                                 for i in range(common["num_hidden_layers"]))  # fmt: skip
    config = Gemma2Config(sliding_window=sliding_window or 4096, layer_types=list(types),
                          query_pre_attn_scalar=query_pre_attn_scalar or common["head_dim"],
                          hidden_activation="gelu_pytorch_tanh", attn_logit_softcapping=attn_cap,
                          final_logit_softcapping=final_cap, pad_token_id=0,
                          **common)  # fmt: skip
    config.architectures = ["Gemma2ForCausalLM"]
    return config


# llama.cpp conversion/phi.py (Phi3MiniModel) and conversion/gemma.py (Gemma2Model)
_GGUF_PHI3_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight",  # fused, as stored
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",  # gate and up, fused
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GGUF_GEMMA2_LAYER = _GGUF_LAYER | {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}


def _write_gguf_phi_gemma2(hf_dir: Path, out: Path, config: dict) -> None:
    """What convert_hf_to_gguf.py writes for Phi3ForCausalLM / Gemma2ForCausalLM."""
    import gguf
    from safetensors.numpy import load_file

    arch = config["model_type"]
    tensors = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    rope = config["rope_parameters"]
    writer = gguf.GGUFWriter(str(out), arch)
    # a name without "phi3": llama.cpp gives models so named Phi-3's special tokens ("</s>"),
    # which the tiny models' SmolLM2 vocabulary lacks (llama-vocab.cpp: it fails to load)
    writer.add_name(f"tiny-{arch}".replace("phi3", "p3"))
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if arch == "phi3":
        original = rope.get("original_max_position_embeddings",
                            config.get("original_max_position_embeddings"))  # fmt: skip
        rot_pct = rope.get("partial_rotary_factor", 1.0)
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_dimension_count(int(rot_pct * hidden) // heads)
        writer.add_rope_freq_base(rope["rope_theta"])
        writer.add_sliding_window(config.get("sliding_window") or 0)
        if rope.get("long_factor"):
            scale = config["max_position_embeddings"] / original
            attn_factor = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1
            writer.add_rope_scaling_attn_factors(attn_factor)
            writer.add_tensor("rope_factors_long.weight",
                              np.array(rope["long_factor"], dtype=np.float32))
            writer.add_tensor("rope_factors_short.weight",
                              np.array(rope["short_factor"], dtype=np.float32))  # fmt: skip
        layer_names = _GGUF_PHI3_LAYER
    else:
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
        writer.add_sliding_window(config["sliding_window"])
        if config["layer_types"] != [("sliding_attention" if (i + 1) % 2 else "full_attention")
                                     for i in range(config["num_hidden_layers"])]:
            writer.add_sliding_window_pattern([t == "sliding_attention"
                                               for t in config["layer_types"]])  # fmt: skip
        layer_names = _GGUF_GEMMA2_LAYER
    _add_tokenizer(writer, hf_dir)
    for name, value in tensors.items():
        if name == "lm_head.weight" and (config["tie_word_embeddings"] or arch == "gemma2"):
            continue
        if name in _GGUF_GLOBAL:
            gguf_name = _GGUF_GLOBAL[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            gguf_name = f"blk.{layer}.{layer_names[rest]}"
        value = np.ascontiguousarray(value, dtype=np.float32)
        if arch == "gemma2" and name.endswith("norm.weight"):
            value = value + np.float32(1.0)  # Gemma2Model.modify_tensors: llama.cpp stores 1 + w
        writer.add_tensor(gguf_name, np.ascontiguousarray(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
