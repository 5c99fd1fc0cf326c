"""Mixtral (MixtralForCausalLM: 8x7B, 8x22B): Mistral's layers with 8 routed experts, top-2, the
two weights always renormalised; experts as wide as `intermediate_size`; a sliding window on
every layer if `sliding_window` is set (the releases set none). Router jitter is training-only.
llama.cpp stores it as `llama` with `llama.expert_count` > 0 and permuted q/k rows."""

from __future__ import annotations

from engine_proc.models.families.common import no_biases, window_fields
from engine_proc.models.families.moe_common import (
    GGUF_EXPERT_NAMES,
    expert_fields,
    gguf_expert_fields,
)
from engine_proc.models.family import Family, GgufKey

NAME = "MixtralForCausalLM"


def hf_fields(raw: dict, common: dict) -> dict:
    no_biases(raw, NAME)
    experts, top_k = int(raw.get("num_local_experts", 8)), int(raw.get("num_experts_per_tok", 2))
    fields = expert_fields(experts, top_k, common["intermediate_size"], NAME)
    return fields | {"norm_topk_prob": True, **window_fields(raw, uses_window=True)}


def gguf_fields(key: GgufKey, common: dict) -> dict:
    return {"architecture": NAME, **gguf_expert_fields(key, common, NAME)}


# gguf_architectures is empty: `llama` GGUFs with experts are picked by registry.family_for_gguf
FAMILY = Family("mixtral", (NAME,), (), hf_fields, gguf_fields,
                gguf_layer_names=GGUF_EXPERT_NAMES, gguf_permutes_qk=True)  # fmt: skip
