"""KV cache events on the wire, and the prefix tree a subscriber rebuilds from them.

The engine publishes one `KVEventBatch` per telemetry tick on the PUB topic `kv_events`
(docs/PROTOCOL.md section 6): vLLM's `kv_events` schema (BlockStored with the parent block's hash
and the block's tokens, BlockRemoved, AllBlocksCleared), each with the medium the block lives in,
plus the pool block id so a view can join the telemetry's per-block arrays. Batches are numbered;
a subscriber that sees a gap asks for a replay (control op `replay_kv_events`): the engine then
publishes AllBlocksCleared followed by every cached block, parents first.

`PrefixTree` applies batches; nothing here imports torch, Qt or engine_proc.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

TOPIC_KV_EVENTS = b"kv_events"


class _KVEvent(msgspec.Struct, tag_field="type", kw_only=True, omit_defaults=True):
    medium: str = "pool"  # pool | host | disk


class BlockStored(_KVEvent, tag="BlockStored"):
    block_hashes: list[bytes]  # one chain: each block's parent is the one before it
    parent_block_hash: bytes | None  # parent of block_hashes[0]; None: a prompt's first block
    token_ids: list[int]  # len(block_hashes) * block_size tokens
    block_size: int
    block_ids: list[int] = msgspec.field(default_factory=list)  # pool blocks (medium "pool")


class BlockRemoved(_KVEvent, tag="BlockRemoved"):
    block_hashes: list[bytes]


class AllBlocksCleared(_KVEvent, tag="AllBlocksCleared"):
    pass


KVEventWire = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, tag="kv_events", tag_field="kind", kw_only=True):
    seq: int  # +1 per batch; a gap means lost events: ask for a replay
    time: float  # engine monotonic clock
    events: list[KVEventWire]


@dataclass(slots=True)
class TreeNode:
    block_hash: bytes
    parent_hash: bytes | None
    block_id: int  # -1 outside the pool
    num_tokens: int
    token_ids: list[int]


class PrefixTree:
    """Cached blocks as a forest: a node per block hash, an edge to the parent block's hash.
    A node whose parent was removed stays, as the root of its own subtree (the engine evicts
    least recently used blocks, which need not be leaves)."""

    def __init__(self) -> None:
        self.nodes: dict[bytes, TreeNode] = {}
        self.last_seq = 0
        self.stale = False  # batches were lost and no AllBlocksCleared has come since
        self.version = 0  # +1 per applied batch that changed something (views redraw on it)

    def apply(self, batch: KVEventBatch) -> bool:
        """Apply a batch; False while the tree may be wrong because batches were lost (ask the
        engine for a replay: its AllBlocksCleared makes the tree whole again)."""
        if self.last_seq and batch.seq != self.last_seq + 1:
            self.stale = True
        self.last_seq = batch.seq
        for event in batch.events:
            if isinstance(event, AllBlocksCleared) and event.medium == "pool":
                self.stale = False
            self._apply_event(event)
        if batch.events:
            self.version += 1
        return not self.stale

    def in_sync(self, published_seq: int) -> bool:
        """Whether the tree reflects every batch up to `published_seq` (the telemetry's
        kv_events_seq): False after a lost batch, even the last one, until a replay arrives."""
        if published_seq != self.last_seq:
            self.stale = True
        return not self.stale

    def _apply_event(self, event: KVEventWire) -> None:
        if isinstance(event, AllBlocksCleared):
            if event.medium == "pool":
                self.nodes.clear()
        elif isinstance(event, BlockStored):
            if event.medium != "pool":
                return
            parent = event.parent_block_hash
            per_block = event.block_size
            for i, h in enumerate(event.block_hashes):
                tokens = event.token_ids[i * per_block : (i + 1) * per_block]
                block_id = event.block_ids[i] if i < len(event.block_ids) else -1
                self.nodes[h] = TreeNode(h, parent, block_id, event.block_size, tokens)
                parent = h
        elif isinstance(event, BlockRemoved):
            if event.medium != "pool":
                return
            for h in event.block_hashes:
                self.nodes.pop(h, None)

    def edges(self) -> dict[bytes, bytes | None]:
        """block hash -> parent hash, the whole forest (what tests compare)."""
        return {h: n.parent_hash for h, n in self.nodes.items()}

    def children(self) -> dict[bytes | None, list[bytes]]:
        """parent hash -> its children's hashes; key None holds the roots (first blocks, and
        blocks whose parent is no longer cached). Built on demand: O(nodes)."""
        out: dict[bytes | None, list[bytes]] = {}
        for h, n in self.nodes.items():
            key = n.parent_hash if n.parent_hash in self.nodes else None
            out.setdefault(key, []).append(h)
        return out
