"""The tiny checkpoints written as llama.cpp GGUF files (what llama.cpp's convert_hf_to_gguf.py
does for these architectures)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.tiny_models.dense import tiny_model_dir
from tests.tiny_models.moe import (
    _GGUF_MOE_ARCH,
    _GGUF_MOE_LAYER,
    _moe_gguf_metadata_and_tensors,
    tiny_moe_model_dir,
)
from tests.tiny_models.phi_gemma2 import PHI_GEMMA2_ARCHITECTURES
from tests.tiny_models.session import BOS_TOKEN_ID, EOS_TOKEN_ID, TOKENIZER_VOCAB_SIZE, _cache


def tiny_gguf_file(architecture: str = "llama", **params: Any) -> Path:
    """The tiny_model_dir(architecture, **params) weights written as llama.cpp would: float32
    GGUF, llama.cpp tensor names, q/k rows permuted for llama, rope_freqs for llama3 scaling,
    the tokenizer's vocabulary and chat template in the metadata."""
    return _gguf_of(tiny_model_dir(architecture, **params))


def tiny_moe_gguf_file(architecture: str = "qwen3_moe", **params: Any) -> Path:
    """tiny_moe_model_dir(architecture, **params) written as llama.cpp's converter writes it:
    experts stacked into ffn_{gate,up,down}_exps, the router as ffn_gate_inp, the expert counts
    in the metadata (Mixtral as `llama`, q/k rows permuted)."""
    return _gguf_of(tiny_moe_model_dir(architecture, **params))


def _gguf_of(hf_dir: Path) -> Path:
    """The GGUF of a tiny checkpoint directory, written once a session."""
    key = f"gguf:{hf_dir}"
    if key not in _cache:
        out = hf_dir.parent / f"{hf_dir.name}.gguf"
        _write_gguf(hf_dir, out)
        _cache[key] = out
    return _cache[key]


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
        # Gemma3Model.norm_shift: llama.cpp stores 1 + w
        gguf_name, value = _gguf_tensor(name, value, layer_names, arch == "gemma3")
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
        # Gemma2Model.modify_tensors: llama.cpp stores 1 + w
        gguf_name, value = _gguf_tensor(name, value, layer_names, arch == "gemma2")
        writer.add_tensor(gguf_name, np.ascontiguousarray(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _gguf_tensor(name: str, value: Any, layer_names: dict[str, str],
                 norm_shift: bool) -> tuple[str, np.ndarray]:  # fmt: skip
    """llama.cpp's name of an HF tensor and its float32 values (Gemma's norms as 1 + w)."""
    if name in _GGUF_GLOBAL:
        gguf_name = _GGUF_GLOBAL[name]
    else:
        _, _, layer, rest = name.split(".", 3)
        gguf_name = f"blk.{layer}.{layer_names[rest]}"
    value = np.ascontiguousarray(value, dtype=np.float32)
    if norm_shift and name.endswith("norm.weight"):
        value = value + np.float32(1.0)
    return gguf_name, value
