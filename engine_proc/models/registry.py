"""Which architecture family a checkpoint is, from config.json `architectures` or GGUF
`general.architecture`; a refusal names what was found and what is supported.

A `Family` describes what differs between families (config fields, extra weights, GGUF tensor
names and conventions); the forward pass over them is one (engine_proc/models/llama.py). One file
per family under engine_proc/models/families/."""

from __future__ import annotations

from typing import Any

from engine_proc.models.config import ModelConfig
from engine_proc.models.families import (
    gemma2,
    gemma3,
    llama,
    mistral,
    mixtral,
    phi3,
    qwen2,
    qwen3,
    qwen3_moe,
)
from engine_proc.models.family import Family

FAMILIES: tuple[Family, ...] = (llama.FAMILY, mistral.FAMILY, qwen2.FAMILY, qwen3.FAMILY,
                                gemma3.FAMILY, phi3.FAMILY, gemma2.FAMILY, qwen3_moe.FAMILY,
                                mixtral.FAMILY)  # fmt: skip

def supported_hf_architectures() -> tuple[str, ...]:
    return tuple(a for f in FAMILIES for a in f.hf_architectures)


def supported_gguf_architectures() -> tuple[str, ...]:
    return tuple(dict.fromkeys(a for f in FAMILIES for a in f.gguf_architectures))


def family_for_hf(architectures: list[str], where: str) -> Family:
    for family in FAMILIES:
        if architectures and architectures[0] in family.hf_architectures:
            return family
    raise ValueError(
        f"{where}: config.json architectures={architectures!r} is not supported; supported "
        f"architectures: {supported_hf_architectures()}"
    )


def family_for_gguf(arch: Any, name: str, where: str, expert_count: int = 0) -> Family:
    """`llama` GGUFs with experts are Mixtral, those named Mistral are Mistral (llama.cpp stores
    both as llama)."""
    if arch == "llama" and expert_count > 0:
        return mixtral.FAMILY
    if arch == "llama" and "mistral" in name.lower():
        return mistral.FAMILY
    for family in FAMILIES:
        if arch in family.gguf_architectures:
            return family
    raise ValueError(
        f"{where}: GGUF general.architecture {arch!r} is not supported; supported GGUF "
        f"architectures: {supported_gguf_architectures()} (from Hugging Face directories: "
        f"{supported_hf_architectures()})"
    )


def extra_layer_weights(config: ModelConfig) -> list[str]:
    """Per-layer weight names (after `model.layers.N.`) beyond Llama's for this config."""
    names = []
    if config.qk_norm:
        names += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    if config.sandwich_norms:
        names += ["pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"]
    return names
