"""What one lower-tier KV entry holds, and what every tier counts.

An entry is one pool block's slice (axis 2) of every pool tensor that holds per-block state: the
K/V values first, then any companion indexed the same way, such as an int8 cache's per-token
scales [layers, 2, blocks, block_size, kv_heads]. A cache whose scales are engine-wide (fp8 with
per-layer scales) has only the values part; such scales are not per block, so they belong in the
cache identity (the root of the prefix-hash chain), not in the entry.

As bytes (the disk tier's payload) an entry is its parts' contiguous C-order bytes, one after
the other in part order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class PartSpec:
    """One part of an entry: a block's slice of one pool tensor."""

    shape: tuple[int, ...]  # [layers, 2, block_size, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class BlockLayout:
    """The pool tensors ([layers, 2, blocks, ...], values first) whose block slices make an
    entry; copies between a pool block and tensors or bytes."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        if not tensors:
            raise ValueError("a KV block layout needs at least the pool tensor")
        head = tensors[0].shape[:3]
        for t in tensors:
            if t.dim() < 3 or t.shape[:3] != head or t.device != tensors[0].device:
                raise ValueError(
                    f"every KV pool tensor must be [layers, 2, blocks, ...] on one device like "
                    f"the pool {tuple(tensors[0].shape)}, got {tuple(t.shape)} on {t.device}"
                )
        self.tensors = tuple(tensors)
        self.parts = tuple(
            PartSpec((t.shape[0], t.shape[1], *t.shape[3:]), t.dtype) for t in self.tensors
        )
        self.block_bytes = sum(p.nbytes for p in self.parts)
        self.device = tensors[0].device

    def block(self, block_id: int) -> list[torch.Tensor]:
        """Views of pool block block_id, one per part (writing into them writes the pool)."""
        return [t[:, :, block_id] for t in self.tensors]

    def to_bytes(self, block_id: int) -> bytes:
        return b"".join(_to_bytes(view) for view in self.block(block_id))

    def from_bytes(self, payload: bytes, block_id: int) -> None:
        assert len(payload) == self.block_bytes, (len(payload), self.block_bytes)
        flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        offset = 0
        for part, out in zip(self.parts, self.block(block_id), strict=True):
            chunk = flat[offset : offset + part.nbytes]
            out.copy_(chunk.view(part.dtype).view(part.shape))
            offset += part.nbytes


@dataclass(slots=True)
class TierStats:
    hits: int = 0  # blocks loaded from this tier into the pool
    stores: int = 0  # blocks written into this tier
    evictions: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    load_seconds: float = 0.0
    store_seconds: float = 0.0
    misses_corrupt: int = 0  # entries found but rejected (checksum, truncated, foreign)
    write_errors: int = 0


def _to_bytes(block: torch.Tensor) -> bytes:
    return block.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
