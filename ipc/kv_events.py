"""KV cache events on the wire, and the prefix tree a subscriber rebuilds from them.

The engine publishes one `KVEventBatch` per telemetry tick on the PUB topic `kv_events`
(docs/PROTOCOL.md section 4.3): vLLM's `kv_events` schema (BlockStored with the parent block's
hash and the block's tokens, BlockRemoved, AllBlocksCleared), each with the medium the block
lives in (the pool, or the host or disk tier below it), plus the pool block id so a view can join
the telemetry's per-block arrays. Batches are numbered; a subscriber that sees a gap asks for a
replay (control op `replay_kv_events`): the engine then publishes AllBlocksCleared for every
medium followed by every block of every medium, parents first.

`PrefixTree` applies batches; nothing here imports torch, Qt or engine_proc.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

TOPIC_KV_EVENTS = b"kv_events"
POOL, HOST, DISK = "pool", "host", "disk"  # the media a block can live in
MEDIA = (POOL, HOST, DISK)


class _KVEvent(msgspec.Struct, tag_field="type", kw_only=True, omit_defaults=True):
    medium: str = POOL  # pool | host (host-memory tier) | disk (disk tier)


class BlockStored(_KVEvent, tag="BlockStored"):
    block_hashes: list[bytes]  # one chain: each block's parent is the one before it
    parent_block_hash: bytes | None  # parent of block_hashes[0]; None: a prompt's first block
    token_ids: list[int]  # len(block_hashes) * block_size tokens
    block_size: int
    block_ids: list[int] = msgspec.field(default_factory=list)  # pool blocks (medium pool only)


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
    media: set[str] = field(default_factory=lambda: {POOL})  # where the block lives now

    @property
    def tier_only(self) -> bool:
        """Evicted from the pool, still held by a lower tier (host memory or disk)."""
        return POOL not in self.media


class PrefixTree:
    """Cached blocks as a forest: a node per block hash, an edge to the parent block's hash,
    and the media that hold the block (the pool, the host and disk tiers below it). A node
    lives while some medium holds it: evicted from the pool but written down to a tier, it
    stays, marked with that tier. A node whose parent is gone stays, as the root of its own
    subtree (the engine evicts least recently used blocks, which need not be leaves)."""

    def __init__(self) -> None:
        self.nodes: dict[bytes, TreeNode] = {}
        self.last_seq = 0
        self.stale = False  # batches were lost and not every medium was cleared since
        self.version = 0  # +1 per applied batch that changed something (views redraw on it)
        self._cleared: set[str] = set()  # media cleared since the tree went stale

    def apply(self, batch: KVEventBatch) -> bool:
        """Apply a batch; False while the tree may be wrong because batches were lost (ask the
        engine for a replay: its AllBlocksCleared of every medium makes the tree whole again)."""
        if self.last_seq and batch.seq != self.last_seq + 1:
            self._lost()
        self.last_seq = batch.seq
        for event in batch.events:
            self._apply_event(event)
            if isinstance(event, AllBlocksCleared) and self.stale:
                self._cleared.add(event.medium)
                self.stale = not self._cleared.issuperset(MEDIA)
        if batch.events:
            self.version += 1
        return not self.stale

    def in_sync(self, published_seq: int) -> bool:
        """Whether the tree reflects every batch up to `published_seq` (the telemetry's
        kv_events_seq): False after a lost batch, even the last one, until a replay arrives."""
        if published_seq != self.last_seq:
            self._lost()
        return not self.stale

    def _lost(self) -> None:
        # Whatever was cleared before the loss may have been refilled by the lost events.
        self.stale = True
        self._cleared = set()

    def _apply_event(self, event: KVEventWire) -> None:
        if isinstance(event, AllBlocksCleared):
            for h in [h for h, n in self.nodes.items() if event.medium in n.media]:
                self._drop(h, event.medium)
        elif isinstance(event, BlockStored):
            parent = event.parent_block_hash
            per_block = event.block_size
            for i, h in enumerate(event.block_hashes):
                tokens = event.token_ids[i * per_block : (i + 1) * per_block]
                block_id = event.block_ids[i] if i < len(event.block_ids) else -1
                self._store(h, parent, tokens, per_block, block_id, event.medium)
                parent = h
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                self._drop(h, event.medium)

    def _store(self, h: bytes, parent: bytes | None, tokens: list[int], block_size: int,
               block_id: int, medium: str) -> None:  # fmt: skip
        node = self.nodes.get(h)
        if node is None:
            pool_id = block_id if medium == POOL else -1
            self.nodes[h] = TreeNode(h, parent, pool_id, block_size, tokens, {medium})
            return
        node.media.add(medium)
        if medium == POOL:  # the pool's description wins: it names the pool block
            node.block_id = block_id
            node.parent_hash, node.token_ids, node.num_tokens = parent, tokens, block_size

    def _drop(self, h: bytes, medium: str) -> None:
        node = self.nodes.get(h)
        if node is None:
            return
        node.media.discard(medium)
        if medium == POOL:
            node.block_id = -1
        if not node.media:
            del self.nodes[h]

    def edges(self) -> dict[bytes, bytes | None]:
        """block hash -> parent hash, the whole forest (what tests compare)."""
        return {h: n.parent_hash for h, n in self.nodes.items()}

    def media(self) -> dict[bytes, frozenset[str]]:
        """block hash -> the media holding it."""
        return {h: frozenset(n.media) for h, n in self.nodes.items()}

    def children(self) -> dict[bytes | None, list[bytes]]:
        """parent hash -> its children's hashes; key None holds the roots (first blocks, and
        blocks whose parent is no longer cached). Built on demand: O(nodes)."""
        out: dict[bytes | None, list[bytes]] = {}
        for h, n in self.nodes.items():
            key = n.parent_hash if n.parent_hash in self.nodes else None
            out.setdefault(key, []).append(h)
        return out
