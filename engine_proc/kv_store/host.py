"""The host-memory KV tier: a compact pool of whole entries (engine_proc/kv_store/entry.py), one
tensor per part ([slots, *part shape]; pinned on CUDA), with an LRU index hash -> slot and each
entry's chain link (parent hash and tokens) for its KV events (engine_proc/core/kv_events.py)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from engine_proc.core.kv_events import (
    HOST,
    NO_LINK,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ChainLink,
    KVEventLog,
    tier_stored,
)
from engine_proc.kv_store.entry import PartSpec, TierStats


class HostTier:
    def __init__(self, num_slots: int, parts: Sequence[PartSpec], pin: bool) -> None:
        assert num_slots > 0 and parts
        self.num_slots = num_slots
        self.parts = tuple(parts)
        self.entry_bytes = sum(p.nbytes for p in self.parts)
        self.data = [
            torch.empty((num_slots, *p.shape), dtype=p.dtype, pin_memory=pin) for p in self.parts
        ]
        self.index: OrderedDict[bytes, int] = OrderedDict()  # LRU first
        self.links: dict[bytes, ChainLink] = {}  # same keys as index
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.stats = TierStats()
        self.events: KVEventLog | None = None  # shared with the pool once events are on

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.index

    def store(
        self, block_hash: bytes, block: Sequence[torch.Tensor], link: ChainLink = NO_LINK
    ) -> None:
        """Copy in one entry: a tensor per part, shaped like that part."""
        if block_hash in self.index:
            self.index.move_to_end(block_hash)
            return
        if not self.free_slots:
            evicted, slot = self.index.popitem(last=False)
            del self.links[evicted]
            self.free_slots.append(slot)
            self.stats.evictions += 1
            if self.events is not None:
                self.events.append(BlockRemoved(evicted, HOST))
        slot = self.free_slots.pop()
        for data, part in zip(self.data, block, strict=True):
            data[slot].copy_(part)
        self.index[block_hash] = slot
        self.links[block_hash] = link
        self.stats.stores += 1
        self.stats.bytes_written += self.entry_bytes
        if self.events is not None:
            self.events.append(tier_stored(block_hash, link, HOST))

    def load(self, block_hash: bytes, out: Sequence[torch.Tensor]) -> bool:
        """Copy the entry into `out` (a tensor per part); False for a miss."""
        slot = self.index.get(block_hash)
        if slot is None:
            return False
        for data, part in zip(self.data, out, strict=True):
            part.copy_(data[slot])
        self.index.move_to_end(block_hash)
        self.stats.hits += 1
        self.stats.bytes_read += self.entry_bytes
        return True

    def clear(self) -> None:
        self.free_slots.extend(self.index.values())
        self.index.clear()
        self.links.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared(HOST))

    def stored_events(self) -> list[BlockStored]:
        """A BlockStored per entry (the host tier's part of a replay)."""
        return [tier_stored(h, self.links[h], HOST) for h in self.index]

    def check(self) -> None:
        slots = list(self.index.values()) + self.free_slots
        assert sorted(slots) == list(range(self.num_slots)), "host tier slots leaked or shared"
        assert self.links.keys() == self.index.keys(), "host tier links differ from its index"
