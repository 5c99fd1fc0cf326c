"""What a found model is, from its headers only: the ModelConfig the loaders would build
(engine_proc/loading: gguf_config / hf_config, the registry's own family check, so a refusal is
the engine's own message), parameter count from tensor shapes (the GGUF tensor table, the
safetensors JSON headers), quantization, size on disk and context length. No tensor data is read
and torch is not imported."""

from __future__ import annotations

import json
import math
import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine_proc.catalog.stores import Found
from engine_proc.loading.gguf_header import GgufFile
from engine_proc.loading.gguf_model import _file_type_name, gguf_config
from engine_proc.loading.hf_dir import _safetensors_files, hf_config
from engine_proc.models.config import ModelConfig

MAX_SAFETENSORS_HEADER = 100 << 20  # the format's own limit on the JSON header


@dataclass(slots=True)
class ModelEntry:
    name: str
    path: str
    store: str
    format: str  # "gguf" | "safetensors"
    architecture: str = ""  # config.json architectures[0] or GGUF general.architecture
    supported: bool = False
    reason: str = ""  # why the engine refuses it ("" when supported)
    params: int = 0  # parameter count from tensor shapes
    quantization: str = ""  # GGUF file_type name (Q4_K_M, F16, ...) or the safetensors dtype
    file_size: int = 0  # bytes on disk
    context_length: int = 0
    config: ModelConfig | None = field(default=None, repr=False)  # when supported

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__ if k != "config"}


def inspect(found: Found) -> ModelEntry:
    entry = ModelEntry(found.name, str(found.path), found.store, found.format)
    try:
        if found.format == "gguf":
            _inspect_gguf(found.path, entry)
        else:
            _inspect_hf(found.path, entry)
    except (OSError, ValueError, KeyError, TypeError, struct.error, UnicodeDecodeError) as exc:
        entry.supported, entry.config = False, None
        entry.reason = entry.reason or _reason(exc)
    return entry


def _reason(exc: BaseException) -> str:
    if isinstance(exc, KeyError):
        return f"cannot read its config: {exc.args[0]!r} is missing"
    return str(exc) or type(exc).__name__


def _inspect_gguf(path: Path, entry: ModelEntry) -> None:
    entry.file_size = path.stat().st_size
    try:
        header = GgufFile(path)
    except (struct.error, UnicodeDecodeError, KeyError) as exc:
        raise ValueError(f"model={str(path)!r}: truncated or corrupt GGUF file ({exc!r})") from exc
    meta = header.metadata
    arch = meta.get("general.architecture")
    entry.architecture = str(arch or "")
    entry.params = sum(math.prod(t.shape) for t in header.tensors.values())
    file_type = meta.get("general.file_type")
    entry.quantization = _file_type_name(file_type) if file_type is not None else _gguf_types(
        header)  # fmt: skip
    entry.context_length = int(meta.get(f"{arch}.context_length") or 0)
    # rope_freqs=False: Llama 3 rope scaling is recovered from a tensor at load time (torch)
    _, _, config = gguf_config(path, rope_freqs=False)
    _supported(entry, config)


def _gguf_types(header: GgufFile) -> str:
    import gguf

    counts = Counter(t.ggml_type for t in header.tensors.values())
    if not counts:
        return ""
    return gguf.GGMLQuantizationType(counts.most_common(1)[0][0]).name


def _inspect_hf(path: Path, entry: ModelEntry) -> None:
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        raw = {}
    if isinstance(raw, dict):
        archs = raw.get("architectures") or []
        entry.architecture = str(archs[0]) if archs else ""
        text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
        entry.context_length = int(text.get("max_position_embeddings") or 0)
    files = _safetensors_files(path)
    entry.file_size = sum(f.stat().st_size for f in files)
    dtypes: Counter[str] = Counter()
    for f in files:
        for info in safetensors_header(f).values():
            n = math.prod(info["shape"])
            entry.params += n
            dtypes[info["dtype"]] += n
    entry.quantization = dtypes.most_common(1)[0][0] if dtypes else ""
    quant = raw.get("quantization_config") if isinstance(raw, dict) else None
    if isinstance(quant, dict) and quant.get("quant_method"):
        entry.quantization = f"{quant['quant_method']} ({entry.quantization})"
    _, _, config = hf_config(path)
    _supported(entry, config)


def _supported(entry: ModelEntry, config: ModelConfig) -> None:
    entry.supported, entry.reason, entry.config = True, "", config
    entry.context_length = config.max_position_embeddings


def safetensors_header(path: Path) -> dict[str, dict]:
    """name -> {"dtype", "shape", "data_offsets"} from a .safetensors file's JSON header (an
    8-byte little-endian length, then that much JSON); no tensor data read."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its header length)")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_SAFETENSORS_HEADER:
            raise ValueError(f"{path}: safetensors header of {length} bytes (corrupt file?)")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: unreadable safetensors header: {exc}") from None
    header.pop("__metadata__", None)
    return header
