"""Qwen3 (dense): Llama's layers plus an RMSNorm of every q and k head before rotary; head_dim
set explicitly (128 at every size, not hidden / heads); no biases."""

from __future__ import annotations

from engine_proc.models.families.common import window_fields
from engine_proc.models.family import Family, GgufKey


def hf_fields(raw: dict, common: dict) -> dict:
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise ValueError("attention_bias / mlp_bias are not supported for Qwen3ForCausalLM")
    return {"qk_norm": True, **window_fields(raw, uses_window=bool(raw.get("use_sliding_window")))}


def gguf_fields(key: GgufKey, common: dict) -> dict:
    return {"architecture": "Qwen3ForCausalLM", "qk_norm": True}


FAMILY = Family(
    "qwen3", ("Qwen3ForCausalLM",), ("qwen3",), hf_fields, gguf_fields,
    gguf_layer_names={"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
)  # fmt: skip
