"""Hugging Face directory (config.json, *.safetensors, tokenizer files) -> Checkpoint, for the
architectures in SUPPORTED_ARCHITECTURES (engine_proc/models/registry.py); what the engine cannot
run (o_proj biases, rope types other than llama3 / linear / Phi-3's longrope) is refused with
the field named. Fused weights (Phi-3's qkv_proj, gate_up_proj) are split into Llama's.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine_proc.loading.checkpoint import (
    ACCEPTED_MODELS,
    Checkpoint,
    ProgressFn,
    expected_weight_names,
    split_fused_weights,
)
from engine_proc.models.config import ModelConfig
from engine_proc.models.family import Family
from engine_proc.models.registry import family_for_hf

if TYPE_CHECKING:  # torch only in annotations: hf_config() runs without it (the model catalog)
    import torch

logger = logging.getLogger(__name__)


def _read_json(path: Path) -> Any:
    """A JSON file; ValueError naming the file when it is unreadable or not JSON."""
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read it as JSON: {exc}") from None


def load_hf_dir(path: Path, dtype: torch.dtype, report: ProgressFn) -> Checkpoint:
    report(0.0, f"reading {path.name}/config.json")
    raw, family, config = hf_config(path)
    files = _safetensors_files(path)
    fused = [f"model.layers.{i}.{name}" for i in range(config.num_layers)
             for name in family.fused_weights]  # fmt: skip
    weights = _read_safetensors(files, config, dtype, report, fused)
    split_fused_weights(config, weights, family.fused_weights)  # Phi-3's qkv_proj, gate_up_proj
    if family.hf_norms_plus_one:  # Gemma's (1 + weight) RMSNorm, folded once
        for name in weights:
            if name.endswith("norm.weight"):
                weights[name] = (weights[name].float() + 1.0).to(dtype)
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


def hf_config(path: Path) -> tuple[dict, Family, ModelConfig]:
    """config.json of a Hugging Face directory -> (its JSON, the family, the ModelConfig), no
    tensors read; ValueError naming what the engine cannot run."""
    raw = _read_json(path / "config.json")
    if not isinstance(raw, dict):
        kind = type(raw).__name__
        raise ValueError(f"{path / 'config.json'}: expected a JSON object, got {kind}")
    family = family_for_hf(raw.get("architectures") or [], f"model={str(path)!r}")
    return raw, family, _hf_config(raw, path, family)


def _hf_config(raw: dict, path: Path, family: Family) -> ModelConfig:
    hidden = int(raw["hidden_size"])
    num_heads = int(raw["num_attention_heads"])
    rope = raw.get("rope_parameters") or {}  # transformers 5 folds rope_theta into this
    theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
    common = dict(
        architecture=raw["architectures"][0],
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
        attention_bias=False,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_hf_eos_ids(raw, path),
    )
    try:
        extra = family.hf_fields(raw, common)
        if "rope_scaling" not in extra:
            extra["rope_scaling"] = _hf_rope_scaling(raw.get("rope_scaling") or rope)
    except ValueError as exc:
        raise ValueError(f"model={str(path)!r}: {exc}") from None
    return ModelConfig(**(common | extra))


def _hf_rope_scaling(scaling: dict) -> dict | None:
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(scaling["factor"])}
    if kind != "llama3":
        raise ValueError(
            f"rope_type={kind!r} is not supported (supported: default, linear, llama3)"
        )
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in scaling]
    if missing:
        raise ValueError(f"llama3 rope scaling lacks {missing}")
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
    files: list[Path], config: ModelConfig, dtype: torch.dtype, report: ProgressFn,
    fused: Iterable[str] = (),
) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    from engine_proc.loading.experts import ExpertStacker  # torch: not on the catalog's path

    wanted = set(expected_weight_names(config)) | {"lm_head.weight"} | set(fused)
    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    keys = [(h, k) for h in handles for k in h.keys()]
    weights: dict[str, torch.Tensor] = {}
    experts = ExpertStacker(config, dtype) if config.num_experts else None
    for i, (handle, name) in enumerate(keys):
        if experts is not None and experts.wants(name):
            experts.take(name, handle.get_tensor(name))
        elif name in wanted:
            weights[name] = handle.get_tensor(name).to(dtype).contiguous()
        else:
            logger.debug("ignoring checkpoint tensor %s", name)
        report(0.95 * (i + 1) / len(keys), f"reading {name} ({i + 1}/{len(keys)})")
    if experts is not None:
        weights |= experts.finish()
    return weights
