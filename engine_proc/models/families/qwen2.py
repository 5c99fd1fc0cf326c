"""Qwen2 / Qwen2.5: Llama's layers with q/k/v biases; a sliding window only when
`use_sliding_window` (rare: the released checkpoints leave it off)."""

from __future__ import annotations

from engine_proc.models.families.common import window_fields
from engine_proc.models.family import Family, GgufKey


def hf_fields(raw: dict, common: dict) -> dict:
    if raw.get("mlp_bias"):
        raise ValueError("mlp_bias is not supported for Qwen2ForCausalLM")
    return {"attention_bias": True,
            **window_fields(raw, uses_window=bool(raw.get("use_sliding_window")))}  # fmt: skip


def gguf_fields(key: GgufKey, common: dict) -> dict:
    return {"architecture": "Qwen2ForCausalLM"}


FAMILY = Family("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), hf_fields, gguf_fields)
