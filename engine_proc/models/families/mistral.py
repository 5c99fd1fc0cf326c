"""Mistral: Llama's layers with a sliding window on every layer (Mistral 7B v0.1: 4,096 tokens;
later releases set none). llama.cpp stores it as `llama` and keeps no window in the GGUF."""

from __future__ import annotations

from engine_proc.models.families.common import no_biases, window_fields
from engine_proc.models.family import Family, GgufKey


def hf_fields(raw: dict, common: dict) -> dict:
    no_biases(raw, "MistralForCausalLM")
    return window_fields(raw, uses_window=True)


def gguf_fields(key: GgufKey, common: dict) -> dict:
    return {"architecture": "MistralForCausalLM"}


FAMILY = Family("mistral", ("MistralForCausalLM",), (), hf_fields, gguf_fields,
                gguf_permutes_qk=True)  # fmt: skip
