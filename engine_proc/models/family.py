"""What an architecture family is to the engine (a `Family`), apart from the registry that picks
one, so that each family's file imports this and the registry imports the families."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# key(name, default) reads `{arch}.{name}` from a GGUF's metadata (ValueError naming it if absent
# and no default); the family turns those into ModelConfig fields.
GgufKey = Callable[[str, Any], Any]


@dataclass(frozen=True, slots=True)
class Family:
    name: str
    hf_architectures: tuple[str, ...]
    gguf_architectures: tuple[str, ...]
    # config.json -> ModelConfig fields beyond the common ones (ValueError naming a field the
    # engine cannot run); also gets the common fields parsed so far.
    hf_fields: Callable[[dict, dict], dict]
    gguf_fields: Callable[[GgufKey, dict], dict]
    # per-layer GGUF tensor names (after `blk.N.`) -> HF names (after `model.layers.N.`) that
    # differ from or add to Llama's
    gguf_layer_names: dict[str, str] = field(default_factory=dict)
    gguf_permutes_qk: bool = False  # llama.cpp interleaves q/k rows of `llama` GGUFs
    hf_norms_plus_one: bool = False  # Gemma stores w of a (1 + w) RMSNorm; llama.cpp stores 1 + w
    # per-layer weights stored fused (HF names after `model.layers.N.`, also what
    # gguf_layer_names maps to) -> the parts they are split into at load, in order; the parts'
    # sizes follow from the config (Phi-3's qkv_proj and gate_up_proj)
    fused_weights: dict[str, tuple[str, ...]] = field(default_factory=dict)
