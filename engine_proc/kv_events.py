"""KV cache events: what the prefix cache stored and removed, in vLLM's `kv_events` schema
(BlockStored with its parent's hash, BlockRemoved, AllBlocksCleared), so a subscriber can rebuild
the tree of cached prefixes without reading the pool. The block pool records them as they happen;
the server drains them into one batch per telemetry tick (docs/PROTOCOL.md, topic `kv_events`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

POOL = "pool"  # the engine's own KV pool (vLLM's "GPU" medium)


@dataclass(slots=True)
class BlockStored:
    block_hash: bytes
    parent_block_hash: bytes | None  # None: the first block of a prompt
    token_ids: list[int]
    block_id: int  # where it lives in the pool (not in vLLM's schema; lets a view join telemetry)
    medium: str = POOL


@dataclass(slots=True)
class BlockRemoved:
    block_hash: bytes
    medium: str = POOL


@dataclass(slots=True)
class AllBlocksCleared:
    medium: str = POOL


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class KVEventLog:
    """Events since the last drain. Bounded: past `max_events` undrained events the log keeps
    only a marker that a replay is needed, so an engine nobody drains cannot grow without end."""

    max_events: int = 200_000
    events: list[KVEvent] = field(default_factory=list)
    overflowed: bool = False

    def append(self, event: KVEvent) -> None:
        if self.overflowed:
            return
        if len(self.events) >= self.max_events:
            self.events.clear()
            self.overflowed = True
            return
        self.events.append(event)

    def drain(self) -> tuple[list[KVEvent], bool]:
        """(events, overflowed): after an overflow the caller must publish a full replay."""
        events, overflowed = self.events, self.overflowed
        self.events, self.overflowed = [], False
        return events, overflowed
