"""Routed-experts models (Qwen3-MoE, Mixtral): their own builder and GGUF pieces."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.tiny_models.dense import _randomize
from tests.tiny_models.session import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    TOKENIZER_VOCAB_SIZE,
    _cache,
    save_to_cache,
)

MOE_ARCHITECTURES = ("qwen3_moe", "mixtral")
_GGUF_MOE_ARCH = {"qwen3_moe": "qwen3moe", "mixtral": "llama"}
# stacked expert tensors (named by _stack_experts_for_gguf) -> llama.cpp's names
_GGUF_MOE_LAYER = {
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.gate_proj": "ffn_gate_exps.weight",
    "mlp.experts.up_proj": "ffn_up_exps.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
}


def tiny_moe_model_dir(
    architecture: str = "qwen3_moe",
    *,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int = 48,
    norm_topk_prob: bool = True,
    decoder_sparse_step: int = 1,
    mlp_only_layers: tuple[int, ...] = (),
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    hidden_size: int = 64,
    intermediate_size: int = 96,
    num_layers: int = 2,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 512,
    rope_theta: float = 10000.0,
    sliding_window: int | None = None,
    seed: int = 0,
) -> Path:
    """A tiny Qwen3-MoE or Mixtral checkpoint directory (transformers' save_pretrained: one
    tensor per expert), built once per parameter set and session. Qwen3-MoE: experts
    moe_intermediate_size wide, dense MLPs (intermediate_size) in mlp_only_layers and where
    decoder_sparse_step skips; Mixtral: experts intermediate_size wide, always renormalised
    (norm_topk_prob, moe_intermediate_size, decoder_sparse_step and mlp_only_layers unused)."""
    params = dict(locals())
    key = "moe:" + json.dumps(params, sort_keys=True)
    if key in _cache:
        return _cache[key]
    if architecture not in MOE_ARCHITECTURES:
        raise ValueError(f"architecture must be one of {MOE_ARCHITECTURES}, got {architecture!r}")
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

    common = dict(
        vocab_size=TOKENIZER_VOCAB_SIZE, hidden_size=hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, head_dim=head_dim,
        max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-5,
        tie_word_embeddings=tie_word_embeddings, bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID, num_experts_per_tok=num_experts_per_tok,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
    )  # fmt: skip
    if architecture == "qwen3_moe":
        config = Qwen3MoeConfig(
            intermediate_size=intermediate_size, moe_intermediate_size=moe_intermediate_size,
            num_experts=num_experts, norm_topk_prob=norm_topk_prob,
            decoder_sparse_step=decoder_sparse_step, mlp_only_layers=list(mlp_only_layers),
            use_sliding_window=sliding_window is not None, sliding_window=sliding_window,
            attention_bias=False, **common)  # fmt: skip
        config.architectures = ["Qwen3MoeForCausalLM"]
    else:
        config = MixtralConfig(intermediate_size=intermediate_size, num_local_experts=num_experts,
                               sliding_window=sliding_window, **common)  # fmt: skip
        config.architectures = ["MixtralForCausalLM"]
    model = AutoModelForCausalLM.from_config(config)
    _randomize(model, seed)
    _randomize_experts(model, seed)
    return save_to_cache(model, "moe-model", key)


@torch.no_grad()
def _randomize_experts(model: torch.nn.Module, seed: int) -> None:
    """Stacked expert weights ([experts, out, in]) scaled by their own fan-in (_randomize takes
    shape[1]); routers 3x wider than that, so routing choices are not near-ties."""
    gen = torch.Generator().manual_seed(seed + 1)
    for name, param in sorted(model.named_parameters()):
        if ".experts." in name or name.endswith("mlp.gate.weight"):
            scale = 3.0 if name.endswith("gate.weight") else 1.0
            value = torch.randn(param.shape, generator=gen) * (scale / math.sqrt(param.shape[-1]))
            param.copy_(value)


def _moe_gguf_metadata_and_tensors(writer: Any, config: dict, tensors: dict) -> dict:
    """llama.cpp's expert keys (conversion/base.py, qwen.py Qwen2MoeModel) and its stacked
    tensors (per-expert ones merged with torch.stack over the expert index)."""
    moe_type = config["model_type"]
    experts = config.get("num_experts", config.get("num_local_experts"))
    if moe_type == "qwen3_moe" and not config.get("norm_topk_prob"):
        raise ValueError("llama.cpp renormalises qwen3moe's top-k weights whatever "
                         "norm_topk_prob says: write only norm_topk_prob=True models")  # fmt: skip
    writer.add_expert_count(experts)
    writer.add_expert_used_count(config["num_experts_per_tok"])
    if moe_type == "qwen3_moe":
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    out = {}
    pieces: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    aliases = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    for name, value in tensors.items():
        parts = name.split(".")
        if ".experts." in name:  # model.layers.N.{mlp,block_sparse_moe}.experts.E.P.weight
            layer, expert, proj = parts[2], int(parts[5]), aliases.get(parts[6], parts[6])
            pieces.setdefault((layer, proj), {})[expert] = value
        elif name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
            out[f"model.layers.{parts[2]}.mlp.gate.weight"] = value
        else:
            out[name] = value
    for (layer, proj), by_expert in pieces.items():
        assert sorted(by_expert) == list(range(experts)), (layer, proj, sorted(by_expert))
        stacked = np.stack([by_expert[e] for e in range(experts)])
        out[f"model.layers.{layer}.mlp.experts.{proj}"] = stacked
    return out
