"""Physical KV blocks: reference counts, the free queue (which is also the LRU eviction order)
and the prefix-hash index."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from engine_proc.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ChainLink,
    KVEventLog,
)


@dataclass(slots=True)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None  # set once the block is full and its prefix is known
    parent: int = -1  # block holding the previous link of the hash chain (for drawing the tree)
    parent_hash: bytes | None = None  # the previous link's hash (None: a prompt's first block)
    token_ids: tuple[int, ...] = ()  # the block's tokens (KV event replays describe them)
    recorded: bool = False  # its BlockStored was logged (a sliding group's copies are not)

    @property
    def link(self) -> ChainLink:
        """What a lower tier keeps with a copy of this block, for its KV events."""
        return ChainLink(self.parent_hash, self.token_ids)


class BlockPool:
    """All blocks of the pool. The free queue is an OrderedDict used as an O(1) doubly linked
    list: its head is allocated next. A freed block keeps its hash and joins the tail, so free
    blocks double as an LRU cache of prefixes; allocation evicts the head's stale hash only
    when the block is actually reused."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        assert num_blocks > 0
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[bytes, int] = {}
        # Called with a cached block about to lose its contents to reuse (lower KV tiers write
        # it down here); None = evicted prefixes are simply gone.
        self.on_evict: Callable[[KVBlock], None] | None = None
        self.events: KVEventLog | None = None  # engine_proc/core/kv_events.py; None = not recorded

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def allocate(self) -> KVBlock:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        assert block.ref_count == 0
        if self.on_evict is not None and block.block_hash is not None:
            self.on_evict(block)
        self._drop_hash(block)
        block.ref_count = 1
        return block

    def touch(self, block: KVBlock) -> None:
        """Take a reference to a block found in the prefix cache. A free cached block is
        revived here, keeping its hash: it must not go through allocate()."""
        if block.ref_count == 0:
            del self.free_queue[block.block_id]
        block.ref_count += 1

    def free(self, block: KVBlock) -> None:
        assert block.ref_count > 0, f"double free of block {block.block_id}"
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_queue[block.block_id] = None
            if block.block_hash is None:
                # Nothing cached in it: reuse it before any block that could still be hit.
                self.free_queue.move_to_end(block.block_id, last=False)

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        if not self.enable_caching:
            return None
        block_id = self.hash_to_block.get(block_hash)
        return None if block_id is None else self.blocks[block_id]

    def cache(
        self,
        block: KVBlock,
        block_hash: bytes,
        parent: int,
        parent_hash: bytes | None = None,
        token_ids: tuple[int, ...] = (),
        record: bool = True,
    ) -> None:
        """Index a full block under its prefix hash. record=False: no KV event (a hybrid
        cache's sliding-group copy of a block the full group already announces)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.hash_to_block:
            return  # an identical block is already indexed; this one stays a private copy
        block.block_hash = block_hash
        block.parent = parent
        block.parent_hash = parent_hash
        self.hash_to_block[block_hash] = block.block_id
        block.token_ids = tuple(token_ids)
        block.recorded = record
        if self.events is not None and record:
            self.events.append(
                BlockStored(block_hash, parent_hash, list(token_ids), block.block_id)
            )

    def uncache(self, block: KVBlock) -> None:
        self._drop_hash(block)

    def reset_prefix_cache(self) -> int:
        """Drop the hashes of every unreferenced block; returns how many were dropped."""
        dropped = 0
        for block_id in self.free_queue:
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._drop_hash(block)
                dropped += 1
        return dropped

    def set_caching(self, enabled: bool) -> None:
        if not enabled:
            for block in self.blocks:
                self._drop_hash(block, quiet=True)
            if self.events is not None:
                self.events.append(AllBlocksCleared())
        self.enable_caching = enabled

    def stored_events(self) -> list[BlockStored]:
        """A BlockStored per cached block, as the pool's part of a replay (kv_events.full_replay
        orders them parents first)."""
        out = []
        for h, block_id in self.hash_to_block.items():
            b = self.blocks[block_id]
            if not b.recorded:
                continue
            out.append(BlockStored(h, b.parent_hash, list(b.token_ids), block_id))
        return out

    def _drop_hash(self, block: KVBlock, quiet: bool = False) -> None:
        if block.block_hash is not None:
            if self.hash_to_block.get(block.block_hash) == block.block_id:
                del self.hash_to_block[block.block_hash]
            if self.events is not None and not quiet and block.recorded:
                self.events.append(BlockRemoved(block.block_hash))
            block.block_hash = None
            block.parent = -1
            block.parent_hash = None
            block.token_ids = ()
            block.recorded = False
