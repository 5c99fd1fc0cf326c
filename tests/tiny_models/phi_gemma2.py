"""Phi-3 and Gemma 2 configs for tiny_model_dir (kept apart from the other families' builders):
Phi-3's fused projections, partial rotary and LongRoPE; Gemma 2's softcapping and sliding layers.
Their GGUF writer is gguf_files.py's."""

from __future__ import annotations

from typing import Any

import torch

PHI_GEMMA2_ARCHITECTURES = ("phi3", "gemma2")  # built by _phi_gemma2_config below


def phi3_longrope(rotary_dims: int, original: int = 32) -> dict:
    """LongRoPE parameters for a tiny Phi-3: seeded short factors in [1, 2) and long ones in
    [2, 10), one per rotary frequency; a small original length, so a 45-token prompt is long."""
    gen = torch.Generator().manual_seed(7)
    n = rotary_dims // 2
    short = (1.0 + torch.rand(n, generator=gen)).tolist()
    long = (2.0 + 8.0 * torch.rand(n, generator=gen)).tolist()
    return {"rope_type": "longrope", "short_factor": [round(x, 4) for x in short],
            "long_factor": [round(x, 4) for x in long],
            "original_max_position_embeddings": original}  # fmt: skip


def _validate_phi_gemma2(architecture: str, attention_bias: bool | None,
                         rope_scaling: str | dict | None) -> None:  # fmt: skip
    if attention_bias:
        raise ValueError(f"{architecture} has no q/k/v biases")
    allowed = ("longrope",) if architecture == "phi3" else ()
    if rope_scaling is not None and rope_scaling not in allowed and not isinstance(rope_scaling,
                                                                                    dict):
        raise ValueError(f"rope_scaling must be None, a dict or one of {allowed}, got "
                         f"{rope_scaling!r}")  # fmt: skip


def _phi_gemma2_config(
    architecture: str, common: dict, rope_theta: float, rope_scaling: str | dict | None,
    sliding_window: int | None, layer_types: tuple[str, ...] | None,
    query_pre_attn_scalar: int | None, partial_rotary_factor: float,
    softcapping: tuple[float | None, float | None],
) -> Any:  # fmt: skip
    from transformers import Gemma2Config, Phi3Config

    if architecture == "phi3":
        # Phi-3 has no head_dim of its own (hidden / heads); its rope carries the rotary fraction
        head_dim = common.pop("head_dim")
        if head_dim != common["hidden_size"] // common["num_attention_heads"]:
            raise ValueError("phi3's head_dim is hidden_size / num_heads")
        rope: dict[str, Any] = {"rope_type": "default"}
        if rope_scaling == "longrope":
            rope = phi3_longrope(int(head_dim * partial_rotary_factor))
        elif isinstance(rope_scaling, dict):
            rope = dict(rope_scaling)
        rope |= {"rope_theta": rope_theta, "partial_rotary_factor": partial_rotary_factor}
        common["rope_parameters"] = rope
        original = rope.get("original_max_position_embeddings",
                            common["max_position_embeddings"])  # fmt: skip
        config = Phi3Config(sliding_window=sliding_window, pad_token_id=0,
                            original_max_position_embeddings=original, **common)  # fmt: skip
        config.architectures = ["Phi3ForCausalLM"]
        return config
    attn_cap, final_cap = softcapping
    types = layer_types or tuple("full_attention" if i % 2 else "sliding_attention"
                                 for i in range(common["num_hidden_layers"]))  # fmt: skip
    config = Gemma2Config(sliding_window=sliding_window or 4096, layer_types=list(types),
                          query_pre_attn_scalar=query_pre_attn_scalar or common["head_dim"],
                          hidden_activation="gelu_pytorch_tanh", attn_logit_softcapping=attn_cap,
                          final_logit_softcapping=final_cap, pad_token_id=0,
                          **common)  # fmt: skip
    config.architectures = ["Gemma2ForCausalLM"]
    return config
