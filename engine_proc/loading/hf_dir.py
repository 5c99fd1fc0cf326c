"""Hugging Face directory (config.json, *.safetensors, tokenizer files) -> Checkpoint, for the
architectures in SUPPORTED_ARCHITECTURES; what the engine cannot run (sliding windows, o_proj
biases, rope types other than llama3) is refused with the field named.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from engine_proc.loading.checkpoint import (
    ACCEPTED_MODELS,
    Checkpoint,
    ProgressFn,
    expected_weight_names,
)
from engine_proc.models.config import SUPPORTED_ARCHITECTURES, ModelConfig

logger = logging.getLogger(__name__)


def _read_json(path: Path) -> Any:
    """A JSON file; ValueError naming the file when it is unreadable or not JSON."""
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read it as JSON: {exc}") from None


def load_hf_dir(path: Path, dtype: torch.dtype, report: ProgressFn) -> Checkpoint:
    report(0.0, f"reading {path.name}/config.json")
    raw = _read_json(path / "config.json")
    if not isinstance(raw, dict):
        kind = type(raw).__name__
        raise ValueError(f"{path / 'config.json'}: expected a JSON object, got {kind}")
    config = _hf_config(raw, path)
    files = _safetensors_files(path)
    weights = _read_safetensors(files, config, dtype, report)
    if "tie_word_embeddings" not in raw and "lm_head.weight" not in weights:
        logger.info("%s: no lm_head.weight and no tie_word_embeddings; treating as tied", path)
        config.tie_word_embeddings = True
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # tied checkpoints sometimes store a copy
    report(0.96, "loading tokenizer")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        raise ValueError(f"model={str(path)!r}: cannot load its tokenizer: {exc}") from exc
    if tokenizer.chat_template is None:
        logger.warning("%s has no chat template; chat messages cannot be formatted", path)
    return Checkpoint(config, weights, tokenizer, str(path), f"{path.name} (safetensors)")


def _hf_config(raw: dict, path: Path) -> ModelConfig:
    architectures = raw.get("architectures") or []
    architecture = architectures[0] if architectures else None
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"model={str(path)!r}: config.json architectures={architectures!r} is not supported; "
            f"SUPPORTED_ARCHITECTURES: {SUPPORTED_ARCHITECTURES}"
        )
    _check_sliding_window(raw, architecture, path)
    if raw.get("mlp_bias") or (architecture != "Qwen2ForCausalLM" and raw.get("attention_bias")):
        raise ValueError(
            f"model={str(path)!r}: mlp_bias / attention_bias (which biases o_proj too) are not "
            "supported for this architecture; only Qwen2's q/k/v biases are"
        )
    hidden = int(raw["hidden_size"])
    num_heads = int(raw["num_attention_heads"])
    rope = raw.get("rope_parameters") or {}  # transformers 5 folds rope_theta into this
    theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(raw.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=architecture == "Qwen2ForCausalLM",
        rope_scaling=_hf_rope_scaling(raw.get("rope_scaling") or rope, path),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_hf_eos_ids(raw, path),
    )


def _check_sliding_window(raw: dict, architecture: str, path: Path) -> None:
    window = raw.get("sliding_window")
    max_pos = raw.get("max_position_embeddings", 0)
    if architecture == "Qwen2ForCausalLM" and not raw.get("use_sliding_window", False):
        return
    if architecture == "LlamaForCausalLM" or window is None or window >= max_pos:
        return
    raise ValueError(
        f"model={str(path)!r}: sliding_window={window} < max_position_embeddings={max_pos}; "
        "sliding-window attention is not supported (only full attention)"
    )


def _hf_rope_scaling(scaling: dict, path: Path) -> dict | None:
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ValueError(
            f"model={str(path)!r}: rope_type={kind!r} is not supported (supported: default, llama3)"
        )
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in scaling]
    if missing:
        raise ValueError(f"model={str(path)!r}: llama3 rope scaling lacks {missing}")
    return {"rope_type": "llama3", **{k: scaling[k] for k in keys}}


def _hf_eos_ids(raw: dict, path: Path) -> tuple[int, ...]:
    ids = list(_as_ids(raw.get("eos_token_id")))
    generation = path / "generation_config.json"
    if generation.is_file():
        gen = _read_json(generation)
        ids += _as_ids(gen.get("eos_token_id") if isinstance(gen, dict) else None)
    return tuple(dict.fromkeys(ids))


def _as_ids(value: int | Iterable[int] | None) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index)["weight_map"]
        files = [path / name for name in dict.fromkeys(weight_map.values())]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"model={str(path)!r} has no *.safetensors files (.bin checkpoints are not supported); "
            f"accepted: {ACCEPTED_MODELS}"
        )
    return files


def _read_safetensors(
    files: list[Path], config: ModelConfig, dtype: torch.dtype, report: ProgressFn
) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    wanted = set(expected_weight_names(config)) | {"lm_head.weight"}
    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    keys = [(h, k) for h in handles for k in h.keys()]
    weights: dict[str, torch.Tensor] = {}
    for i, (handle, name) in enumerate(keys):
        if name in wanted:
            weights[name] = handle.get_tensor(name).to(dtype).contiguous()
        else:
            logger.debug("ignoring checkpoint tensor %s", name)
        report(0.95 * (i + 1) / len(keys), f"reading {name} ({i + 1}/{len(keys)})")
    return weights
