"""Llama 1-3.x (and what else is stored as `llama` in GGUF: SmolLM, TinyLlama, ...)."""

from __future__ import annotations

from engine_proc.models.families.common import no_biases
from engine_proc.models.family import Family, GgufKey


def hf_fields(raw: dict, common: dict) -> dict:
    no_biases(raw, "LlamaForCausalLM")
    return {}


def gguf_fields(key: GgufKey, common: dict) -> dict:
    return {}


FAMILY = Family("llama", ("LlamaForCausalLM",), ("llama",), hf_fields, gguf_fields,
                gguf_permutes_qk=True)  # fmt: skip
