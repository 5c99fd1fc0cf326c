"""Phi-3 / Phi-3.5 / Phi-4 / Phi-4-mini (Phi3ForCausalLM): Llama's layer with q/k/v stored as one
`qkv_proj` and gate/up as one `gate_up_proj` (split at load), LongRoPE scaling (short and long
per-frequency factors, an attention factor on cos/sin), partial rotary (Phi-4-mini: the first
3/4 of each head) and, on Phi-3-mini-4k, a sliding window on every layer. head_dim is always
hidden / heads.

llama.cpp's GGUF (`phi3`) stores `attn_qkv` and `ffn_up` (gate and up) fused,
rope_factors_long/short tensors, rope.scaling.attn_factor / original_context_length and
rope.dimension_count (the rotary part); it writes sliding_window 0 for none. llama.cpp itself
runs Phi-3 without the window (its loader turns SWA off for phi3); we keep it, as transformers
does."""

from __future__ import annotations

import math

import numpy as np

from engine_proc.models.families.common import no_biases, window_fields
from engine_proc.models.family import Family, GgufKey

FUSED = {
    "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                  "self_attn.v_proj.weight"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}  # fmt: skip


def f32(x: float) -> float:
    """A value as float32 holds it (transformers multiplies float32 tensors by it; GGUF stores
    float32), so configs from both sources compare equal."""
    return float(np.float32(x))


def longrope(short: list, long: list, original: int, attention_factor: float) -> dict:
    return {"rope_type": "longrope", "short_factor": tuple(f32(x) for x in short),
            "long_factor": tuple(f32(x) for x in long),
            "original_max_position_embeddings": int(original),
            "attention_factor": f32(attention_factor)}  # fmt: skip


def default_attention_factor(factor: float, original: int) -> float:
    """transformers' (and llama.cpp's converter's) sqrt(1 + ln(factor) / ln(original))."""
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def hf_fields(raw: dict, common: dict) -> dict:
    no_biases(raw, "Phi3ForCausalLM")
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={raw['hidden_act']!r} is not supported for Phi3ForCausalLM "
                         "(silu)")  # fmt: skip
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    head_dim = common["hidden_size"] // common["num_heads"]
    partial = float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    rotary = int(head_dim * partial)
    if not 0 < rotary <= head_dim or rotary % 2:
        raise ValueError(f"partial_rotary_factor={partial}: rotary part of {rotary} of each "
                         f"{head_dim}-wide head (even, > 0 expected)")  # fmt: skip
    fields: dict = {"head_dim": head_dim, "rotary_dim": rotary if rotary < head_dim else None,
                    **window_fields(raw, uses_window=True)}  # fmt: skip
    kind = rope.get("rope_type", rope.get("type"))
    if kind in ("longrope", "su"):
        original = int(rope.get("original_max_position_embeddings",
                                raw.get("original_max_position_embeddings", 0)))  # fmt: skip
        if not original or "short_factor" not in rope or "long_factor" not in rope:
            raise ValueError("longrope rope_scaling needs short_factor, long_factor and "
                             "original_max_position_embeddings")  # fmt: skip
        for name in ("short_factor", "long_factor"):
            if len(rope[name]) != rotary // 2:
                raise ValueError(f"longrope {name} has {len(rope[name])} entries, expected "
                                 f"{rotary // 2} (rotary dims / 2)")  # fmt: skip
        factor = rope.get("factor") or common["max_position_embeddings"] / original
        attention = rope.get("attention_factor")
        if attention is None:
            attention = default_attention_factor(float(factor), original)
        fields["rope_scaling"] = longrope(rope["short_factor"], rope["long_factor"], original,
                                          attention)  # fmt: skip
    elif kind in (None, "default"):
        fields["rope_scaling"] = None
    else:
        raise ValueError(f"rope_type={kind!r} is not supported for Phi3ForCausalLM "
                         "(default, longrope)")  # fmt: skip
    return fields


def gguf_fields(key: GgufKey, common: dict) -> dict:
    fields: dict = {"architecture": "Phi3ForCausalLM"}
    window = int(key("attention.sliding_window", 0) or 0)
    if window and window < common["max_position_embeddings"]:
        fields |= {"sliding_window": window,
                   "layer_types": ("sliding_attention",) * common["num_layers"]}  # fmt: skip
    return fields  # rope_scaling (longrope): loading/gguf_model.py, from the factor tensors


FAMILY = Family(
    "phi3", ("Phi3ForCausalLM",), ("phi3",), hf_fields, gguf_fields,
    gguf_layer_names={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    fused_weights=FUSED,
)  # fmt: skip
