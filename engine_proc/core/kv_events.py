"""KV cache events: what the prefix cache stored and removed, in vLLM's `kv_events` schema
(BlockStored with its parent's hash, BlockRemoved, AllBlocksCleared), each tagged with the medium
the block lives in: the pool, or the host or disk tier below it (engine_proc/kv_store/tiers.py). A
subscriber rebuilds the tree of cached prefixes, and where each block lives, without reading the
pool. The block pool and the tiers record them as they happen into one KVEventLog; the server
drains it into one batch per telemetry tick (docs/PROTOCOL.md, topic `kv_events`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

POOL = "pool"  # the engine's own KV pool (vLLM's "GPU" medium)
HOST = "host"  # the host-memory tier below it
DISK = "disk"  # the disk tier, which outlives the process
MEDIA = (POOL, HOST, DISK)


class ChainLink(NamedTuple):
    """What a tier keeps of a block besides its values, so its events can name the parent."""

    parent_hash: bytes | None  # None: a prompt's first block (or unknown: published as a root)
    token_ids: tuple[int, ...]


NO_LINK = ChainLink(None, ())


@dataclass(slots=True)
class BlockStored:
    block_hash: bytes
    parent_block_hash: bytes | None  # None: the first block of a prompt
    token_ids: list[int]
    block_id: int  # where it lives in the pool (not in vLLM's schema; lets a view join telemetry)
    medium: str = POOL  # outside the pool block_id is -1


@dataclass(slots=True)
class BlockRemoved:
    block_hash: bytes
    medium: str = POOL


@dataclass(slots=True)
class AllBlocksCleared:
    medium: str = POOL


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def tier_stored(block_hash: bytes, link: ChainLink, medium: str) -> BlockStored:
    return BlockStored(block_hash, link.parent_hash, list(link.token_ids), -1, medium)


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

    def queue_replay(self, replay: list[KVEvent]) -> None:
        """Not bounded by max_events: a replay is at most one event per block and medium."""
        self.events.extend(replay)

    def drain(self) -> tuple[list[KVEvent], bool]:
        """(events, overflowed): after an overflow the caller must publish a full replay."""
        events, overflowed = self.events, self.overflowed
        self.events, self.overflowed = [], False
        return events, overflowed


def full_replay(stored: list[BlockStored]) -> list[KVEvent]:
    """What a subscriber that lost events rebuilds its tree from: AllBlocksCleared for every
    medium, then `stored` (a BlockStored per block and medium holding it) with each block after
    its parent, wherever the parent lives. Blocks keep their given order otherwise, so one
    medium's chains stay together (the wire merges them into one event each)."""
    by_hash: dict[bytes, list[BlockStored]] = {}
    for e in stored:
        by_hash.setdefault(e.block_hash, []).append(e)
    out: list[KVEvent] = [AllBlocksCleared(m) for m in MEDIA]
    known: set[bytes] = set()  # hashes already published, in some medium
    emitted: set[int] = set()  # id() of the events already in `out`
    for e in stored:
        chain: list[BlockStored] = []
        x = e
        while id(x) not in emitted:
            chain.append(x)
            emitted.add(id(x))
            p = x.parent_block_hash
            if p is None or p in known or p not in by_hash:
                break
            # the parent from the same medium when it is there too: it continues the chain
            x = next((c for c in by_hash[p] if c.medium == x.medium), by_hash[p][0])
        for x in reversed(chain):
            known.add(x.block_hash)
            out.append(x)
    return out
