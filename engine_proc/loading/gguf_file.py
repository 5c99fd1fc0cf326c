"""GGUF files without gguf's slow reader: the header and tensor table read with struct, the tensors
as views of one mmap, dequantized to float32 torch tensors (the common llama.cpp block formats
in torch, vectorised over the whole tensor; anything else through gguf.quants)."""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch


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


# ggml type ids (gguf.GGMLQuantizationType) of the formats dequantized here in torch
F32, F16, Q4_0, Q4_1, Q8_0, BF16 = 0, 1, 2, 3, 8, 30


def dequantize(tensor: GgufTensor) -> torch.Tensor:
    """float32 torch tensor in PyTorch dim order (ggml's ne0, the innermost dim, comes last)."""
    shape = tuple(reversed(tensor.shape))
    fast = _TORCH_DEQUANT.get(tensor.ggml_type)
    if fast is not None:
        raw = torch.from_numpy(np.array(tensor.data, copy=True).reshape(-1))  # off the mmap
        return fast(raw).reshape(shape).contiguous()
    import gguf
    from gguf.quants import dequantize as gguf_dequantize

    array = gguf_dequantize(tensor.data, gguf.GGMLQuantizationType(tensor.ggml_type))
    array = np.asarray(array, dtype=np.float32).reshape(shape)
    if not array.flags.writeable or not array.flags.c_contiguous:
        array = np.array(array, dtype=np.float32, order="C")  # F32 tensors are read-only mmaps
    return torch.from_numpy(array)


def _blocks(raw: torch.Tensor, block_bytes: int) -> torch.Tensor:
    return raw.reshape(-1, block_bytes)


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte offset `at` of every block, as float32 [blocks, 1]."""
    return blocks[:, at : at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """ggml's 4-bit layout: byte j holds element j (low nibble) and j + 16 (high nibble)."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=1).float()


def _q4_0(raw: torch.Tensor) -> torch.Tensor:  # 32 weights: f16 d, 16 B codes; w = (q - 8) d
    b = _blocks(raw, 18)
    return (_nibbles(b[:, 2:]) - 8.0) * _f16(b, 0)


def _q4_1(raw: torch.Tensor) -> torch.Tensor:  # f16 d, f16 m, 16 B codes; w = q d + m
    b = _blocks(raw, 20)
    return _nibbles(b[:, 4:]) * _f16(b, 0) + _f16(b, 2)


def _q8_0(raw: torch.Tensor) -> torch.Tensor:  # f16 d, 32 x int8; w = q d
    b = _blocks(raw, 34)
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b, 0)


_TORCH_DEQUANT = {
    F32: lambda raw: raw.view(torch.float32).clone(),
    F16: lambda raw: raw.view(torch.float16).float(),
    BF16: lambda raw: raw.view(torch.bfloat16).float(),
    Q4_0: _q4_0,
    Q4_1: _q4_1,
    Q8_0: _q8_0,
}
