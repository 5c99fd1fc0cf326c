"""Gemma 2 (Gemma2ForCausalLM: 2B, 9B, 27B): sliding-window and global layers alternating
(`layer_types`; by default layer 0 sliding), attention logit soft-capping and final logit
soft-capping (cap * tanh(x / cap)), Gemma's four norms per layer with (1 + weight) RMSNorm,
`query_pre_attn_scalar`, embeddings times sqrt(hidden), a GELU-tanh MLP, tied embeddings, one
rotary base for every layer; no q/k norms.

llama.cpp's GGUF (`gemma2`) has the window and both caps; its layer pattern is a period of 2
(the last layer of each pair global) unless attention.sliding_window_pattern says otherwise; it
stores the norms as 1 + weight and uses 1/sqrt(head_dim) as the attention scale but for the 27B
model (46 layers), where it is 1/sqrt(hidden / heads), as that model's query_pre_attn_scalar."""

from __future__ import annotations

import math

import numpy as np

from engine_proc.models.config import FULL_ATTENTION, SLIDING_ATTENTION
from engine_proc.models.families.common import window_fields
from engine_proc.models.families.gemma3 import ACTIVATIONS, gguf_layer_pattern
from engine_proc.models.families.gemma3 import FAMILY as GEMMA3
from engine_proc.models.family import Family, GgufKey

GGUF_SLIDING_PATTERN = 2
GGUF_WINDOW = 4096  # llama.cpp's default for gemma2


def _cap(raw: dict, name: str) -> float | None:
    value = raw.get(name)
    if value is None:
        return None
    if float(value) <= 0:
        raise ValueError(f"{name}={value!r}: a positive cap or null expected")
    return float(np.float32(value))  # as transformers' float32 arithmetic and GGUF hold it


def hf_fields(raw: dict, common: dict) -> dict:
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ACTIVATIONS:
        raise ValueError(f"hidden_activation={act!r} is not supported; supported: "
                         f"{tuple(ACTIVATIONS)}")  # fmt: skip
    if raw.get("attention_bias"):
        raise ValueError("attention_bias=true is not supported for Gemma2ForCausalLM")
    num_layers = common["num_layers"]
    if raw.get("layer_types") is None:  # transformers' default: sliding first, alternating
        raw = {**raw, "layer_types": [SLIDING_ATTENTION if (i + 1) % 2 else FULL_ATTENTION
                                      for i in range(num_layers)]}  # fmt: skip
    if raw.get("sliding_window") is None:
        raw = {**raw, "sliding_window": GGUF_WINDOW}
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type"))
    if kind not in (None, "default"):
        raise ValueError(f"rope_type={kind!r} is not supported for Gemma2ForCausalLM (default)")
    return {
        "sandwich_norms": True,
        "hidden_act": ACTIVATIONS[act],
        "embed_scale": math.sqrt(common["hidden_size"]),
        "query_scale": float(raw.get("query_pre_attn_scalar", common["head_dim"])) ** -0.5,
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", True)),
        "attn_logit_softcap": _cap(raw, "attn_logit_softcapping"),
        "final_logit_softcap": _cap(raw, "final_logit_softcapping"),
        "rope_scaling": None,
        **window_fields(raw, uses_window=True),
    }


def gguf_fields(key: GgufKey, common: dict) -> dict:
    num_layers = common["num_layers"]
    types = gguf_layer_pattern(key, num_layers, "gemma2", GGUF_SLIDING_PATTERN)
    head = common["hidden_size"] // common["num_heads"] if num_layers == 46 else common["head_dim"]
    fields = {
        "architecture": "Gemma2ForCausalLM",
        "sandwich_norms": True,
        "hidden_act": "gelu_tanh",
        "embed_scale": math.sqrt(common["hidden_size"]),
        "query_scale": float(head) ** -0.5,
        "attn_logit_softcap": _gguf_cap(key, "attn_logit_softcapping"),
        "final_logit_softcap": _gguf_cap(key, "final_logit_softcapping"),
    }
    window = int(key("attention.sliding_window", GGUF_WINDOW) or 0)
    if window and window < common["max_position_embeddings"] and SLIDING_ATTENTION in types:
        fields |= {"sliding_window": window, "layer_types": types}
    if key("rope.scaling.type", "none") != "none":
        raise ValueError(f"gemma2.rope.scaling.type={key('rope.scaling.type', 'none')!r} is not "
                         "supported (none)")  # fmt: skip
    return fields


def _gguf_cap(key: GgufKey, name: str) -> float | None:
    value = float(key(name, 0.0) or 0.0)  # llama.cpp: absent = no cap
    return value if value > 0 else None


FAMILY = Family(
    "gemma2", ("Gemma2ForCausalLM",), ("gemma2",), hf_fields, gguf_fields,
    gguf_layer_names={k: v for k, v in GEMMA3.gguf_layer_names.items()
                      if k not in ("attn_q_norm", "attn_k_norm")},
    hf_norms_plus_one=True,
)  # fmt: skip
