"""A GGUF file's header without torch or gguf's slow reader: the metadata and the tensor table
read with struct, each tensor a view of one mmap (dequantized by gguf_file.py). The model catalog
(engine_proc/catalog) reads models' metadata and tensor shapes through this without torch."""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(slots=True)
class GgufTensor:
    name: str
    shape: tuple[int, ...]  # ggml order: ne0 (the innermost, contiguous dim) first
    ggml_type: int  # gguf.GGMLQuantizationType value
    data: np.ndarray  # raw bytes, uint8 [rows, bytes per row], a view of the file's mmap


class GgufFile:
    """Metadata and tensor table of a GGUF (v2/v3, little-endian) file, read with struct.

    gguf.GGUFReader builds a numpy view per metadata string, which takes 5-8 s on SmolLM2's
    49k-token vocabulary; this reads the same header in well under a second. The tensors are
    dequantized with gguf.quants.dequantize all the same. Arrays longer than
    MAX_ARRAY_ITEMS are skipped (their metadata value is the item count).
    """

    MAX_ARRAY_ITEMS = 1024
    _SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                10: "<Q", 11: "<q", 12: "<d"}  # fmt: skip
    _STRING, _ARRAY = 8, 9

    def __init__(self, path: Path) -> None:
        import gguf

        self.path = path
        self._mmap = np.memmap(path, dtype=np.uint8, mode="r")
        self._buf = memoryview(self._mmap)
        if bytes(self._buf[:4]) != b"GGUF":
            raise ValueError(f"model={str(path)!r} is not a GGUF file (bad magic)")
        version, tensor_count, kv_count = struct.unpack_from("<IQQ", self._buf, 4)
        if version not in (2, 3):
            raise ValueError(f"model={str(path)!r}: GGUF version {version} is not supported (2, 3)")
        self._pos = 24
        self.metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._string()
            (value_type,) = self._unpack("<I")
            self.metadata[key] = self._value(value_type)
        infos = []
        for _ in range(tensor_count):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            shape = self._unpack(f"<{n_dims}Q")
            ggml_type, offset = self._unpack("<IQ")
            infos.append((name, shape, ggml_type, offset))
        alignment = int(self.metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT))
        start = -(-self._pos // alignment) * alignment
        self.tensors: dict[str, GgufTensor] = {}
        for name, shape, ggml_type, offset in infos:
            try:
                qtype = gguf.GGMLQuantizationType(ggml_type)
            except ValueError:
                raise ValueError(
                    f"model={str(path)!r}: tensor {name} has unknown ggml type {ggml_type}"
                ) from None
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            assert shape[0] % block == 0, (name, shape, block)
            row_bytes = shape[0] // block * type_size
            rows = math.prod(shape[1:])
            begin = start + offset
            if begin + rows * row_bytes > self._mmap.size:
                raise ValueError(f"model={str(path)!r}: tensor {name} runs past the file's end")
            data = self._mmap[begin : begin + rows * row_bytes].reshape(rows, row_bytes)
            self.tensors[name] = GgufTensor(name, tuple(shape), ggml_type, data)

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (length,) = self._unpack("<Q")
        text = bytes(self._buf[self._pos : self._pos + length]).decode("utf-8", errors="replace")
        self._pos += length
        return text

    def _value(self, value_type: int) -> Any:
        if value_type == self._STRING:
            return self._string()
        if value_type in self._SCALARS:
            return self._unpack(self._SCALARS[value_type])[0]
        if value_type != self._ARRAY:
            raise ValueError(f"model={str(self.path)!r}: unknown GGUF value type {value_type}")
        item_type, count = self._unpack("<IQ")
        if count <= self.MAX_ARRAY_ITEMS:
            return [self._value(item_type) for _ in range(count)]
        if item_type in self._SCALARS:
            self._pos += count * struct.calcsize(self._SCALARS[item_type])
        else:
            for _ in range(count):
                self._value(item_type)
        return count
