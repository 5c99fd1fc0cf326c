"""The engine's native KV events (engine_proc/core/kv_events.py) -> vLLM's (ipc/vllm_events).

Media: the pool is "GPU" (vLLM's name for the first tier, whatever device the pool is on), the
host tier "CPU", the disk tier "DISK". Hashes: the low 64 bits of the engine's 32-byte chain
hashes, or the whole digest (hash_type "bytes"). Consecutive stores of one chain become one
BlockStored and consecutive removals one BlockRemoved, as vLLM batches them.

vLLM's AllBlocksCleared has no medium: it means every block is gone. The engine clears one
medium at a time (its lower tiers on reset_prefix_cache, while the pool drops its free blocks one
by one), so the converter keeps the set of blocks it has published per medium: a clear becomes
BlockRemoved of that medium's blocks, and a run of removals that leaves nothing published at
all becomes one AllBlocksCleared (what vLLM publishes on reset_prefix_cache).

Only the full-attention group's blocks have events (a hybrid cache's sliding-group copies are
not announced natively), so every event is group 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine_proc.core.kv_events import DISK, HOST, POOL, AllBlocksCleared, BlockStored
from ipc.vllm_events import events as V
from ipc.vllm_events.encode import wire_hash

MEDIA = {POOL: V.MEDIUM_GPU, HOST: V.MEDIUM_CPU, DISK: V.MEDIUM_DISK}


@dataclass(slots=True)
class Converter:
    block_size: int
    hash_type: str = "int"
    group_idx: int = 0
    # native medium -> native hashes published there and not removed since (insertion order)
    published: dict[str, dict[bytes, None]] = field(default_factory=dict)

    def convert(self, native: Sequence[Any]) -> list[V.Event]:
        out: list[V.Event] = []
        for e in native:
            if isinstance(e, BlockStored):
                self._stored(out, e)
            elif isinstance(e, AllBlocksCleared):
                gone = list(self.published.pop(e.medium, {}))
                self._removed(out, gone, e.medium)
            else:  # BlockRemoved
                self.published.get(e.medium, {}).pop(e.block_hash, None)
                self._removed(out, [e.block_hash], e.medium)
        return out

    def _stored(self, out: list[V.Event], e: BlockStored) -> None:
        self.published.setdefault(e.medium, {})[e.block_hash] = None
        h = wire_hash(e.block_hash, self.hash_type)
        parent = None if e.parent_block_hash is None else wire_hash(e.parent_block_hash,
                                                                    self.hash_type)  # fmt: skip
        medium = MEDIA[e.medium]
        last = out[-1] if out else None
        if (isinstance(last, V.Stored) and last.medium == medium
                and parent == last.block_hashes[-1] and len(e.token_ids) == self.block_size
                and len(last.token_ids) == self.block_size * len(last.block_hashes)):  # fmt: skip
            out[-1] = V.Stored(
                last.block_hashes + (h,), last.parent_block_hash,
                last.token_ids + tuple(e.token_ids), self.block_size, medium, self.group_idx,
            )  # fmt: skip
            return
        out.append(V.Stored((h,), parent, tuple(e.token_ids), self.block_size, medium,
                            self.group_idx))  # fmt: skip

    def _removed(self, out: list[V.Event], hashes: list[bytes], native_medium: str) -> None:
        if not any(self.published.values()):
            self._clear_all(out)
            return
        if not hashes:
            return
        medium = MEDIA[native_medium]
        wire = tuple(wire_hash(h, self.hash_type) for h in hashes)
        last = out[-1] if out else None
        if isinstance(last, V.Removed) and last.medium == medium:
            out[-1] = V.Removed(last.block_hashes + wire, medium, self.group_idx)
        else:
            out.append(V.Removed(wire, medium, self.group_idx))

    @staticmethod
    def _clear_all(out: list[V.Event]) -> None:
        """Nothing is published any more: the removals since the last store (which emptied it)
        and this one are one AllBlocksCleared."""
        while out and isinstance(out[-1], V.Removed | V.Cleared):
            out.pop()
        out.append(V.Cleared())
