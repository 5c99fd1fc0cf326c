"""The session's cache of tiny checkpoints (one temporary directory, removed at exit) and the
tokenizer every tiny model shares (the default SmolLM2 GGUF's: vocab 49152, chat template,
bos 1, eos 2)."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

TOKENIZER_VOCAB_SIZE = 49152
BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2

_root: Path | None = None
_cache: dict[str, Path] = {}


def _session_dir() -> Path:
    global _root
    if _root is None:
        _root = Path(tempfile.mkdtemp(prefix="kvscope-tiny-models-"))
        atexit.register(shutil.rmtree, _root, ignore_errors=True)
    return _root


def tiny_tokenizer_dir() -> Path:
    """A directory holding the default model's tokenizer, saved with save_pretrained."""
    if "tokenizer" not in _cache:
        from transformers import PreTrainedTokenizerFast

        from engine_proc.loading.loader import default_model_path

        gguf_path = default_model_path()
        tokenizer = PreTrainedTokenizerFast.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name
        )
        assert tokenizer.chat_template, "the default GGUF should carry a chat template"
        assert len(tokenizer) == TOKENIZER_VOCAB_SIZE, len(tokenizer)
        out = _session_dir() / "tokenizer"
        tokenizer.save_pretrained(str(out))
        _cache["tokenizer"] = out
    return _cache["tokenizer"]


def save_to_cache(model: object, stem: str, key: str) -> Path:
    """Save a tiny transformers model with the shared tokenizer under the session directory,
    cached under `key`."""
    out = _session_dir() / f"{stem}-{len(_cache)}"
    model.save_pretrained(str(out))
    for item in tiny_tokenizer_dir().iterdir():
        shutil.copy(item, out / item.name)
    _cache[key] = out
    return out
