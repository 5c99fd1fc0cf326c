"""Gemma 3 text models (Gemma3ForCausalLM: 270M, 1B; the larger ones' language model in the same
layout): five sliding-window layers to one global layer (`layer_types`), a local rotary base for
the sliding layers, q/k norms, four norms per layer, Gemma's (1 + weight) RMSNorm,
`query_pre_attn_scalar`, embeddings times sqrt(hidden), a GELU-tanh MLP, tied embeddings.

llama.cpp's GGUF has the window, `rope.freq_base_swa` and maybe `attention.sliding_window_pattern`
(a period or one flag per layer); without them its defaults hold (every sixth layer global, local
base 10,000), as here. It stores the norms as 1 + weight already."""

from __future__ import annotations

import math

from engine_proc.models.config import FULL_ATTENTION, SLIDING_ATTENTION
from engine_proc.models.families.common import window_fields
from engine_proc.models.family import Family, GgufKey

GGUF_SLIDING_PATTERN = 6  # llama.cpp: every sixth layer is global
GGUF_LOCAL_ROPE_BASE = 10_000.0
ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def hf_fields(raw: dict, common: dict) -> dict:
    for cap in ("final_logit_softcapping", "attn_logit_softcapping"):
        if raw.get(cap) is not None:
            raise ValueError(f"{cap}={raw[cap]!r} is not supported for Gemma3ForCausalLM "
                             "(null expected)")  # fmt: skip
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ACTIVATIONS:
        raise ValueError(f"hidden_activation={act!r} is not supported; supported: "
                         f"{tuple(ACTIVATIONS)}")  # fmt: skip
    if raw.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=true (an encoder) is not supported")
    rope = raw.get("rope_parameters") or {}
    full = rope.get(FULL_ATTENTION, {})
    local = rope.get(SLIDING_ATTENTION, {})
    fields = {
        "qk_norm": True,
        "sandwich_norms": True,
        "hidden_act": ACTIVATIONS[act],
        "embed_scale": math.sqrt(common["hidden_size"]),
        "query_scale": float(raw.get("query_pre_attn_scalar", common["head_dim"])) ** -0.5,
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", True)),
        "rope_theta": float(full.get("rope_theta", raw.get("rope_theta", 1_000_000.0))),
        "rope_local_theta": float(local.get("rope_theta",
                                            raw.get("rope_local_base_freq", 10_000.0))),
        **window_fields(raw, uses_window=True),
    }  # fmt: skip
    scaling = full if full else (raw.get("rope_scaling") or {})
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        fields["rope_scaling"] = {"rope_type": "linear", "factor": float(scaling["factor"])}
    elif kind not in (None, "default"):
        raise ValueError(f"rope_type={kind!r} is not supported for Gemma 3 (default, linear)")
    else:
        fields["rope_scaling"] = None
    return fields


def gguf_layer_pattern(key: GgufKey, num_layers: int, arch: str,
                       default: int) -> tuple[str, ...]:  # fmt: skip
    """llama.cpp's load_swa_pattern: attention.sliding_window_pattern as one flag per layer or
    a period (default `default`) whose last layer is global."""
    pattern = key("attention.sliding_window_pattern", default)
    if isinstance(pattern, list | tuple):
        if len(pattern) != num_layers:
            raise ValueError(f"{arch}.attention.sliding_window_pattern has {len(pattern)} flags "
                             f"for {num_layers} layers")  # fmt: skip
        flags = [bool(f) for f in pattern]
    else:  # llama.cpp's set_swa_pattern: the last layer of every period is global
        n = int(pattern)
        flags = [n == 0 or i % n < n - 1 for i in range(num_layers)]
    return tuple(SLIDING_ATTENTION if f else FULL_ATTENTION for f in flags)


def gguf_fields(key: GgufKey, common: dict) -> dict:
    num_layers = common["num_layers"]
    types = gguf_layer_pattern(key, num_layers, "gemma3", GGUF_SLIDING_PATTERN)
    # llama.cpp's attention scale: 1/sqrt(head_dim), but 1/sqrt(hidden/heads) for the 27B model
    # (62 layers), as its query_pre_attn_scalar says
    head = common["hidden_size"] // common["num_heads"] if num_layers == 62 else common["head_dim"]
    fields = {
        "architecture": "Gemma3ForCausalLM",
        "qk_norm": True,
        "sandwich_norms": True,
        "hidden_act": "gelu_tanh",
        "embed_scale": math.sqrt(common["hidden_size"]),
        "query_scale": float(head) ** -0.5,
        "rope_local_theta": float(key("rope.freq_base_swa", GGUF_LOCAL_ROPE_BASE)),
    }
    window = int(key("attention.sliding_window", 0) or 0)
    if window and SLIDING_ATTENTION in types:
        fields |= {"sliding_window": window, "layer_types": types}
    kind = key("rope.scaling.type", "none")
    if kind == "linear":
        fields["rope_scaling"] = {"rope_type": "linear",
                                  "factor": float(key("rope.scaling.factor", None))}  # fmt: skip
    elif kind != "none":
        raise ValueError(f"gemma3.rope.scaling.type={kind!r} is not supported (none, linear)")
    return fields


FAMILY = Family(
    "gemma3", ("Gemma3ForCausalLM",), ("gemma3",), hf_fields, gguf_fields,
    gguf_layer_names={
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    hf_norms_plus_one=True,
)  # fmt: skip
