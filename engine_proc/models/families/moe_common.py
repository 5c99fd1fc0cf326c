"""Routed-experts fields that Qwen3-MoE and Mixtral read alike."""

from __future__ import annotations

from engine_proc.models.family import GgufKey

# llama.cpp's per-layer names (after `blk.N.`) -> ours (after `model.layers.N.`); the 3-D
# `_exps` tensors are stacked into gate_up by engine_proc/loading/experts.py
GGUF_EXPERT_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}


def expert_fields(num_experts: int, top_k: int, width: int, family: str) -> dict:
    """ValueError naming the field when the counts cannot describe a routed-experts MLP."""
    if num_experts < 1:
        raise ValueError(f"num_experts={num_experts} for {family}: at least 1 expected")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok={top_k} for {family}: expected 1..{num_experts}")
    if width < 1:
        raise ValueError(f"moe_intermediate_size={width} for {family}: at least 1 expected")
    return {"num_experts": num_experts, "num_experts_per_tok": top_k,
            "moe_intermediate_size": width}  # fmt: skip


def gguf_expert_fields(key: GgufKey, common: dict, family: str) -> dict:
    """llama.cpp's `{arch}.expert_count`, `expert_used_count` and `expert_feed_forward_length`
    (absent for Mixtral, whose experts are feed_forward_length wide). llama.cpp renormalises the
    top-k weights of both families (build_moe_ffn's norm_w), so a GGUF says norm_topk_prob."""
    width = int(key("expert_feed_forward_length", common["intermediate_size"]))
    fields = expert_fields(int(key("expert_count", None)), int(key("expert_used_count", None)),
                           width, family)  # fmt: skip
    return fields | {"norm_topk_prob": True}
