"""Qwen3-MoE (Qwen3MoeForCausalLM: 30B-A3B, 235B-A22B): Qwen3's attention (q/k norms) with
routed experts in place of the MLP; `norm_topk_prob` renormalises the top-k weights (true in the
releases); `decoder_sparse_step` and `mlp_only_layers` keep a dense MLP (`intermediate_size`
wide) in some layers. The router's auxiliary loss is training-only. llama.cpp: `qwen3moe`."""

from __future__ import annotations

from engine_proc.models.families.common import window_fields
from engine_proc.models.families.moe_common import (
    GGUF_EXPERT_NAMES,
    expert_fields,
    gguf_expert_fields,
)
from engine_proc.models.family import Family, GgufKey

NAME = "Qwen3MoeForCausalLM"


def hf_fields(raw: dict, common: dict) -> dict:
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise ValueError(f"attention_bias / mlp_bias are not supported for {NAME}")
    # transformers 5 saves num_experts as num_local_experts
    num_experts = int(raw.get("num_experts", raw.get("num_local_experts", 0)) or 0)
    fields = expert_fields(num_experts, int(raw.get("num_experts_per_tok", 0) or 0),
                           int(raw.get("moe_intermediate_size", 0) or 0), NAME)  # fmt: skip
    step = raw.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"decoder_sparse_step={step!r} for {NAME}: a positive integer expected")
    only = raw.get("mlp_only_layers") or []
    num_layers = common["num_layers"]
    if not all(isinstance(i, int) and 0 <= i < num_layers for i in only):
        raise ValueError(f"mlp_only_layers={only!r} for {NAME}: layer indices "
                         f"0..{num_layers - 1} expected")  # fmt: skip
    dense = tuple(i for i in range(num_layers) if i in only or (i + 1) % step)
    return fields | {
        "norm_topk_prob": bool(raw.get("norm_topk_prob", False)),
        "dense_mlp_layers": dense,
        "qk_norm": True,
        **window_fields(raw, uses_window=bool(raw.get("use_sliding_window"))),
    }


def gguf_fields(key: GgufKey, common: dict) -> dict:
    return {"architecture": NAME, "qk_norm": True, **gguf_expert_fields(key, common, NAME)}


FAMILY = Family(
    "qwen3_moe", (NAME,), ("qwen3moe",), hf_fields, gguf_fields,
    gguf_layer_names={"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
                      **GGUF_EXPERT_NAMES},
)  # fmt: skip
