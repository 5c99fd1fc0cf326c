"""The tokenizer of a GGUF file, built by transformers from the file's vocabulary and cached on
disk (`tokenizer_cache_dir()`), so later starts skip the conversion.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

CACHE_LAYOUT = 1  # bump when what the tokenizer cache stores changes


def gguf_tokenizer(path: Path, chat_template: str | None) -> PreTrainedTokenizerBase:
    """The tokenizer transformers builds from the GGUF's vocabulary, cached on disk.

    PreTrainedTokenizerFast with gguf_file builds the same tokenizer AutoTokenizer does (same
    class in transformers 5) but skips AutoTokenizer's slow config pass over the whole file.
    Converting the vocabulary takes about a second; the result is saved under
    `tokenizer_cache_dir()` keyed by the file (path, size, mtime) and the transformers version,
    and later starts load that instead. Any cache problem just means building it again.
    """
    from transformers import PreTrainedTokenizerFast

    t0 = time.perf_counter()
    cached = _tokenizer_cache_entry(path)
    tokenizer = None
    if cached is not None and (cached / "tokenizer.json").is_file():
        try:
            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(cached))
        except Exception as exc:  # a damaged entry: rebuild it
            logger.info("ignoring cached tokenizer %s: %s", cached, exc)
    if tokenizer is None:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
        if tokenizer.chat_template is None and chat_template:
            tokenizer.chat_template = chat_template
        if cached is not None:
            _save_tokenizer(tokenizer, cached)
    if tokenizer.chat_template is None:
        logger.warning("%s has no chat template; chat messages cannot be formatted", path.name)
    logger.debug("tokenizer from %s in %.2f s", path.name, time.perf_counter() - t0)
    return tokenizer


def tokenizer_cache_dir() -> Path | None:
    """$KVSCOPE_CACHE_DIR/tokenizers, else ~/.cache/kvscope/tokenizers ($XDG_CACHE_HOME
    honoured); KVSCOPE_CACHE_DIR set to an empty string turns the cache off."""
    root = os.environ.get("KVSCOPE_CACHE_DIR")
    if root == "":
        return None
    if root is None:
        xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        root = str(Path(xdg) / "kvscope")
    return Path(root) / "tokenizers"


def _tokenizer_cache_entry(path: Path) -> Path | None:
    base = tokenizer_cache_dir()
    if base is None:
        return None
    try:
        st = path.stat()
        version = importlib.metadata.version("transformers")
    except (OSError, importlib.metadata.PackageNotFoundError):
        return None
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{version}|{CACHE_LAYOUT}"
    return base / hashlib.sha256(key.encode()).hexdigest()[:24]


def _save_tokenizer(tokenizer: PreTrainedTokenizerBase, entry: Path) -> None:
    """Write into a temporary directory, then rename: a crash never leaves half an entry."""
    tmp: Path | None = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=entry.parent))
        tokenizer.save_pretrained(str(tmp))
        os.replace(tmp, entry)
    except OSError as exc:  # read-only home, disk full, a racing start already wrote it
        logger.info("tokenizer not cached (%s)", exc)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
