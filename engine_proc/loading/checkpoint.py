"""What a loaded model is: the `Checkpoint` (config, weights under Hugging Face names, tokenizer),
the sources the loader accepts, and the weight names and shapes a config implies, which every
checkpoint is checked against whatever file it came from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine_proc.models.config import ModelConfig
from engine_proc.models.registry import (
    extra_layer_weights,
    supported_gguf_architectures,
    supported_hf_architectures,
)

if TYPE_CHECKING:  # torch only in annotations: the model catalog reads configs without it
    import torch
    from transformers import PreTrainedTokenizerBase

SUPPORTED_ARCHITECTURES = supported_hf_architectures()
SUPPORTED_GGUF_ARCHITECTURES = supported_gguf_architectures()

ACCEPTED_MODELS = (
    "None (the default SmolLM2-135M-Instruct GGUF), a path to a local .gguf file "
    f"(general.architecture in {SUPPORTED_GGUF_ARCHITECTURES}), or a local Hugging Face directory "
    f"with config.json and *.safetensors (architectures in {SUPPORTED_ARCHITECTURES})"
)

ProgressFn = Callable[[float, str], None]
# a routed-experts layer's MLP weights (after `model.layers.N.`): router, stacked experts
EXPERT_WEIGHTS = ("mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj")


@dataclass(slots=True)
class Checkpoint:
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # Hugging Face names, CPU tensors, in the requested dtype
    tokenizer: PreTrainedTokenizerBase
    model_id: str  # absolute resolved path of the weights file/dir
    display_name: str


# --------------------------------------------------------------------------------------------
# Validation


def expected_weight_names(config: ModelConfig) -> list[str]:
    """Every weight name the engine reads for this config, in a stable order."""
    names = ["model.embed_tokens.weight"]
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        names.append(p + "input_layernorm.weight")
        names += [f"{p}self_attn.{x}_proj.weight" for x in "qkvo"]
        if config.attention_bias:
            names += [f"{p}self_attn.{x}_proj.bias" for x in "qkv"]
        names.append(p + "post_attention_layernorm.weight")
        if config.layer_has_experts(i):  # stacked as transformers 5 holds them (models/moe.py)
            names += [p + n for n in EXPERT_WEIGHTS]
        else:
            names += [f"{p}mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        names += [p + n for n in extra_layer_weights(config)]
    names.append("model.norm.weight")
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_suffix = {
        "input_layernorm.weight": (c.hidden_size,),
        "post_attention_layernorm.weight": (c.hidden_size,),
        "self_attn.q_proj.weight": (q, c.hidden_size),
        "self_attn.k_proj.weight": (kv, c.hidden_size),
        "self_attn.v_proj.weight": (kv, c.hidden_size),
        "self_attn.o_proj.weight": (c.hidden_size, q),
        "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.bias": (kv,),
        "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
        "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
        "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
        "self_attn.q_norm.weight": (c.head_dim,),
        "self_attn.k_norm.weight": (c.head_dim,),
        "pre_feedforward_layernorm.weight": (c.hidden_size,),
        "post_feedforward_layernorm.weight": (c.hidden_size,),
        "mlp.gate.weight": (c.num_experts, c.hidden_size),
        "mlp.experts.gate_up_proj": (c.num_experts, 2 * c.moe_intermediate_size, c.hidden_size),
        "mlp.experts.down_proj": (c.num_experts, c.hidden_size, c.moe_intermediate_size),
    }
    shapes = {
        "model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
        "model.norm.weight": (c.hidden_size,),
        "lm_head.weight": (c.vocab_size, c.hidden_size),
    }
    return {
        name: shapes[name] if name in shapes else per_suffix[name.split(".", 3)[3]]
        for name in expected_weight_names(config)
    }


def split_fused_weights(config: ModelConfig, weights: dict[str, torch.Tensor],
                        fused: dict[str, tuple[str, ...]]) -> None:  # fmt: skip
    """Replace fused per-layer weights (Phi-3's qkv_proj, gate_up_proj) by their parts, rows
    in order, sized as the config implies; ValueError naming a fused weight of the wrong size."""
    if not fused:
        return
    shapes = expected_weight_shapes(config)
    for name in [n for n in weights if n.startswith("model.layers.")]:
        suffix = name.split(".", 3)[3]
        if suffix not in fused:
            continue
        prefix = name[: -len(suffix)]
        sizes = [shapes[prefix + part][0] for part in fused[suffix]]
        tensor = weights.pop(name)
        if tensor.shape[0] != sum(sizes):
            raise ValueError(f"checkpoint weight {name} has {tensor.shape[0]} rows, config "
                             f"implies {sum(sizes)} ({' + '.join(map(str, sizes))})")  # fmt: skip
        for part, piece in zip(fused[suffix], tensor.split(sizes), strict=True):
            weights[prefix + part] = piece.contiguous()


def check_weights(config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    expected = expected_weight_shapes(config)
    missing = [n for n in expected if n not in weights]
    extra = [n for n in weights if n not in expected]
    if missing or extra:
        raise ValueError(
            f"checkpoint weights do not match its config: missing {missing[:5]} "
            f"({len(missing)} in all), unexpected {extra[:5]} ({len(extra)} in all)"
        )
    wrong = {n: tuple(w.shape) for n, w in weights.items() if tuple(w.shape) != expected[n]}
    if wrong:
        name = next(iter(wrong))
        raise ValueError(
            f"checkpoint weight {name} has shape {wrong[name]}, config implies {expected[name]} "
            f"({len(wrong)} mismatched in all)"
        )
