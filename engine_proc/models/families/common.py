"""Checks several families share."""

from __future__ import annotations

from engine_proc.models.config import FULL_ATTENTION, SLIDING_ATTENTION


def no_biases(raw: dict, family: str) -> None:
    if raw.get("mlp_bias") or raw.get("attention_bias"):
        raise ValueError(
            f"mlp_bias / attention_bias (which biases o_proj too) are not supported for {family}; "
            "only Qwen2's q/k/v biases are"
        )


def window_fields(raw: dict, uses_window: bool) -> dict:
    """sliding_window on every layer (Mistral, Qwen2/3 with use_sliding_window), or per layer
    from `layer_types`. A window as long as the context is full attention."""
    window = raw.get("sliding_window")
    num_layers = int(raw["num_hidden_layers"])
    max_pos = int(raw.get("max_position_embeddings", 2048))
    if not uses_window or not window or int(window) >= max_pos:
        return {}
    window = int(window)
    types = raw.get("layer_types")
    if types is None:
        # Qwen2/3 `max_window_layers`: layers from that index on use the window
        first = int(raw.get("max_window_layers", 0) or 0) if "max_window_layers" in raw else 0
        types = [SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(num_layers)]
    bad = [t for t in types if t not in (FULL_ATTENTION, SLIDING_ATTENTION)]
    if bad or len(types) != num_layers:
        raise ValueError(
            f"layer_types={types!r}: expected {num_layers} entries from "
            f"{(FULL_ATTENTION, SLIDING_ATTENTION)}"
        )
    if SLIDING_ATTENTION not in types:
        return {}
    return {"sliding_window": window, "layer_types": tuple(types)}
