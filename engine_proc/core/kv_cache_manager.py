"""Per-sequence KV policy over the block pool: block tables, prefix matching, allocation with
copy-on-write for forked sequences, and hashing of blocks as they fill.

A hybrid model (engine_proc/core/kv_groups.py) gives each sequence one more table per sliding
group: those tables release the blocks that left the window (`trim`), their blocks are indexed
under group-tagged hashes, and a prefix hit needs the full group's whole prefix but only the last
window's blocks of each sliding group. A model whose every layer slides has one group, a sliding
one: its block_table itself releases blocks (NO_BLOCK entries), and a hit needs only the last
window's blocks of the prefix, wherever the blocks before them went."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable
from typing import Protocol

from engine_proc.core.block_pool import BlockPool, KVBlock
from engine_proc.core.kv_events import ChainLink
from engine_proc.core.kv_groups import first_needed_block
from engine_proc.core.request import Sequence

NO_BLOCK = -1  # a sliding group's table entry for a block released (or never held)


class CachedPrefix(list):
    """A prefix hit: group 0's blocks (the list itself, as without groups; None below the
    window when group 0 slides) and, per other group, its blocks for the same prefix (None
    below the window)."""

    group_blocks: list[list[KVBlock | None]]

    def __init__(self, blocks: list[KVBlock], group_blocks: list[list[KVBlock | None]]) -> None:
        super().__init__(blocks)
        self.group_blocks = group_blocks


def group_key(block_hash: bytes, group: int) -> bytes:
    """The index key of a block of `group`: the full group's is its prefix hash, a sliding
    group's the same hash tagged with the group (the pool's index is shared)."""
    if group == 0:
        return block_hash
    return hashlib.sha256(block_hash + b"\0kv-group\0" + bytes([group])).digest()


class LowerTiers(Protocol):
    """The KV tiers below the pool as the manager uses them (engine_proc/kv_store/tiers.py
    KVTiers): the policy here, the storage there, so core imports no storage code."""

    write_through: bool
    queries: int  # tokens looked up below the pool
    hit_tokens: int  # tokens loaded from below the pool
    link_of: Callable[[int], ChainLink] | None

    def contains(self, block_hash: bytes) -> bool: ...
    def store(self, block_hash: bytes, block_id: int) -> None: ...
    def load(self, block_hash: bytes, block_id: int) -> str | None: ...


def root_hash(model_id: str, cache_salt: str | None) -> bytes:
    """Every input that changes K/V besides the tokens themselves, each tagged by its type."""
    h = hashlib.sha256(b"kvscope-prefix-v1\0model\0")
    h.update(model_id.encode())
    if cache_salt is not None:
        h.update(b"\0cache_salt\0")
        h.update(cache_salt.encode())
    return h.digest()


def longrope_root(root: bytes) -> bytes:
    """The prefix-hash root of a sequence whose K/V is rotated with LongRoPE's long factors:
    the same tokens under the short factors are other K/V."""
    return hashlib.sha256(root + b"\0longrope-long\0").digest()


def block_hash(parent_hash: bytes, token_ids: list[int]) -> bytes:
    # sha256 of fixed-width token ids: stable across processes and PYTHONHASHSEED.
    return hashlib.sha256(parent_hash + array("i", token_ids).tobytes()).digest()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool,
                 windows: tuple[int | None, ...] = (None,)) -> None:  # fmt: skip
        # group 0 slides only when every layer does (kv_groups.plan_layout)
        assert all(w for w in windows[1:]) and (windows[0] is None or len(windows) == 1), windows
        self.windows = windows  # per group (kv_groups.KVLayout.windows)
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.tiers: LowerTiers | None = None  # lower KV tiers (host, disk); see attach_tiers
        self.pending_stores: list[tuple[int, bytes]] = []  # write-through, after the step runs

    def attach_tiers(self, tiers: LowerTiers) -> None:
        """Evicted cached blocks are written down into `tiers`, and prefix lookups continue
        there after the pool (engine_proc/kv_store/tiers.py)."""
        self.tiers = tiers
        self.pool.on_evict = lambda block: tiers.store(block.block_hash, block.block_id)
        tiers.link_of = lambda block_id: self.pool.blocks[block_id].link  # for the KV events

    @property
    def enable_caching(self) -> bool:
        return self.pool.enable_caching

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def full_block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """Hashes of the first num_blocks blocks of seq (all must be full of known tokens)."""
        hashes = seq.block_hashes
        bs = self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else seq.root_hash
            hashes.append(block_hash(parent, seq.token_ids[i * bs : (i + 1) * bs]))
        return hashes[:num_blocks]

    def find_cached_prefix(self, seq: Sequence) -> list[KVBlock]:
        """Longest chain of cached blocks matching seq's tokens. Leaves at least the last token
        to compute: the sampler needs its logits."""
        if not self.enable_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hit: list[KVBlock] = []
        hashes = self.full_block_hashes(seq, max_blocks)
        if self.windows[0] is not None:
            return self._sliding_hit(hashes)
        for h in hashes:
            block = self.pool.lookup(h)
            if block is None:
                break
            hit.append(block)
        if self.tiers is not None and len(hit) < max_blocks:
            hit = self._load_from_tiers(seq, hashes, hit)
        if len(self.windows) > 1:
            return self._hybrid_hit(hashes, hit)
        return hit

    def _sliding_hit(self, hashes: list[bytes]) -> CachedPrefix | list[KVBlock]:
        """Every layer slides: the longest prefix whose last window's blocks the pool holds
        (hashes chain the whole prefix, so a block found is that prefix's). A scan keeps, per
        end k, the run of held blocks ending at k - 1."""
        window, bs = self.windows[0], self.block_size
        assert window is not None
        found = [self.pool.lookup(h) for h in hashes]
        best, run = 0, 0
        for k in range(1, len(found) + 1):
            run = run + 1 if found[k - 1] is not None else 0
            if k - run <= first_needed_block(k * bs, window, bs):
                best = k
        if not best:
            return []
        first = first_needed_block(best * bs, window, bs)
        return CachedPrefix([None] * first + found[first:best], [])

    def _hybrid_hit(self, hashes: list[bytes], hit: list[KVBlock]) -> CachedPrefix:
        """The longest prefix of `hit` whose last window's blocks every sliding group holds."""
        bs = self.block_size
        for k in range(len(hit), -1, -1):
            groups: list[list[KVBlock | None]] = []
            for g, window in enumerate(self.windows[1:], 1):
                first = first_needed_block(k * bs, window, bs)
                blocks: list[KVBlock | None] = [None] * min(first, k)
                for j in range(first, k):
                    block = self.pool.lookup(group_key(hashes[j], g))
                    if block is None:
                        break
                    blocks.append(block)
                if len(blocks) < k:
                    break
                groups.append(blocks)
            else:
                return CachedPrefix(hit[:k], groups)
        raise AssertionError("an empty prefix always fits")

    def _load_from_tiers(
        self, seq: Sequence, hashes: list[bytes], hit: list[KVBlock]
    ) -> list[KVBlock]:
        """Continue the prefix walk below the pool: each next block comes from the pool if it
        holds it, else from the host or disk tier into a newly allocated pool block (a
        synchronous copy, inside the scheduler step). Every block of the walk stays pinned
        (referenced) until the walk ends, so loading never evicts the prefix it extends; the
        loaded blocks end as ordinary cached blocks at the LRU tail."""
        assert self.tiers is not None
        pool = self.pool
        for block in hit:
            pool.touch(block)
        try:
            for h in hashes[len(hit) :]:
                block = pool.lookup(h)
                if block is not None:
                    pool.touch(block)
                    hit.append(block)
                    continue
                if pool.num_free == 0 or not self.tiers.contains(h):
                    break
                block = pool.allocate()  # may evict (and write down) the pool's LRU block
                if self.tiers.load(h, block.block_id) is None:  # corrupt entry: a miss
                    pool.free(block)
                    break
                i = len(hit)
                pool.cache(
                    block,
                    h,
                    hit[-1].block_id if hit else -1,
                    hashes[i - 1] if i else None,
                    tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size]),
                )
                assert block.block_hash == h
                hit.append(block)
                seq.num_external_cached_tokens += self.block_size
        finally:
            for block in reversed(hit):  # the tail is freed first, so it is evicted first
                pool.free(block)
        return hit

    def count_external(self, seq: Sequence, num_cached: int) -> None:
        """At admission: tokens the lower tiers were asked for (those the pool lacked) and
        tokens they served (vLLM's external_prefix_cache_queries / _hits)."""
        if self.tiers is None or not self.enable_caching:
            return
        external = min(seq.num_external_cached_tokens, num_cached)
        self.tiers.queries += seq.num_tokens - (num_cached - external)
        self.tiers.hit_tokens += external
        seq.num_external_cached_tokens = 0

    def flush_pending_stores(self) -> None:
        """Write-through: store the blocks filled by the step that just ran."""
        pending, self.pending_stores = self.pending_stores, []
        if self.tiers is None:
            return
        for block_id, h in pending:
            if self.pool.blocks[block_id].block_hash == h:
                self.tiers.store(h, block_id)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int, cached: list[KVBlock]) -> int:
        """Free blocks that allocate() would consume, including revived cached ones."""
        computed = seq.num_computed_tokens + len(cached) * self.block_size
        total = self.num_blocks_for(computed + num_new_tokens)
        need = 0
        for g, window in enumerate(self.windows):
            table = self._group_table(seq, g)
            got = self._cached_in(cached, g)
            first = 0 if window is None else first_needed_block(computed, window, self.block_size)
            need += max(0, total - max(len(table) + len(got), first))
            need += sum(1 for b in got if b is not None and b.ref_count == 0)  # revived
            need += int(self._needs_copy_in(table, seq.num_computed_tokens))
        return need

    @staticmethod
    def _cached_in(cached: list, group: int) -> list[KVBlock | None]:
        if group == 0:
            return cached
        return cached.group_blocks[group - 1] if isinstance(cached, CachedPrefix) else []

    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached: list[KVBlock]) -> bool:
        return self.blocks_needed(seq, num_new_tokens, cached) <= self.pool.num_free

    def allocate(
        self, seq: Sequence, num_new_tokens: int, cached: list[KVBlock]
    ) -> list[tuple[int, int]]:
        """Give seq the blocks for its next num_new_tokens tokens; returns (src, dst) block
        copies the runner must do before writing (copy-on-write of a shared partial block)."""
        assert self.can_allocate(seq, num_new_tokens, cached)
        pool = self.pool
        for g in range(len(self.windows)):  # before any allocation, which could evict them
            table = self._group_table(seq, g)
            for block in self._cached_in(cached, g):
                if block is not None:
                    pool.touch(block)
                table.append(NO_BLOCK if block is None else block.block_id)
        seq.num_computed_tokens += len(cached) * self.block_size
        copies: list[tuple[int, int]] = []
        end = seq.num_computed_tokens + num_new_tokens
        for g in range(len(self.windows)):
            table = self._group_table(seq, g)
            if self._needs_copy_in(table, seq.num_computed_tokens):
                i = seq.num_computed_tokens // self.block_size
                old = pool.blocks[table[i]]
                new = pool.allocate()
                copies.append((old.block_id, new.block_id))
                pool.free(old)
                table[i] = new.block_id
            window = self.windows[g]
            first = (0 if window is None else
                     first_needed_block(seq.num_computed_tokens, window, self.block_size))
            while len(table) < self.num_blocks_for(end):
                table.append(NO_BLOCK if len(table) < first else pool.allocate().block_id)
        # Only blocks full of known tokens: a speculative step's drafts (past num_tokens) are
        # not in the hash chain until the target model confirms them (rollback below).
        self._cache_full_blocks(seq, seq.num_computed_tokens // self.block_size,
                                min(end, seq.num_tokens) // self.block_size)  # fmt: skip
        return copies

    def rollback(self, seq: Sequence, num_known: int) -> None:
        """After a speculative step of seq, which knew num_known tokens when it was scheduled:
        keep the K/V of all but its newest token (the confirmed drafts' K/V is its own, the
        rejected ones' is forgotten), free the blocks only rejected drafts filled, and index
        the blocks the confirmed drafts filled."""
        keep = seq.num_tokens - 1
        assert num_known <= keep + 1 and keep <= seq.num_computed_tokens, (num_known, keep)
        num_blocks = self.num_blocks_for(keep)
        # Every group alike: a sliding group's window only moves forward (keep is past what was
        # computed before the step), so its released blocks stay released.
        for table in (seq.block_table, *seq.group_tables):
            for block_id in reversed(table[num_blocks:]):
                if block_id == NO_BLOCK:
                    continue
                block = self.pool.blocks[block_id]
                # never indexed (allocate hashes known tokens only) and never shared (fresh)
                assert block.block_hash is None and block.ref_count == 1, block
                self.pool.free(block)
            del table[num_blocks:]
        seq.num_computed_tokens = keep
        self._cache_full_blocks(seq, num_known // self.block_size, keep // self.block_size)

    def _group_table(self, seq: Sequence, group: int) -> list[int]:
        if group == 0:
            return seq.block_table
        while len(seq.group_tables) < group:
            seq.group_tables.append([])
        return seq.group_tables[group - 1]

    def trim(self, seq: Sequence) -> None:
        """Release the sliding groups' blocks that left the window: the next query of seq no
        longer reads them. Freed with their hashes, they stay hittable until evicted."""
        for g, window in enumerate(self.windows):
            if window is None:
                continue
            table = self._group_table(seq, g)
            first = min(first_needed_block(seq.num_computed_tokens, window, self.block_size),
                        len(table))  # fmt: skip
            for i in range(first - 1, -1, -1):
                if table[i] == NO_BLOCK:
                    break  # released up to here before
                self.pool.free(self.pool.blocks[table[i]])
                table[i] = NO_BLOCK

    def _needs_copy_in(self, table: list[int], num_computed: int) -> bool:
        # Only a forked sequence can write into a block someone else references: prefix hits
        # are whole blocks that are never written again.
        i = num_computed // self.block_size
        if i >= len(table) or num_computed % self.block_size == 0 or table[i] == NO_BLOCK:
            return False
        return self.pool.blocks[table[i]].ref_count > 1

    def _cache_full_blocks(self, seq: Sequence, first: int, num_full: int) -> None:
        # Blocks are indexed when scheduled to be filled: the forward pass writes every layer's
        # K/V before any attention reads it, so a request scheduled later in the same step
        # can already share them.
        if not self.enable_caching or first >= num_full:  # no block filled up this step
            return
        hashes = self.full_block_hashes(seq, num_full)
        write_through = self.tiers is not None and self.tiers.write_through
        bs = self.block_size
        for i in range(first, num_full):
            h = hashes[i]
            if seq.block_table[i] == NO_BLOCK:  # every layer slides: released before it filled
                continue
            parent = seq.block_table[i - 1] if i else -1
            if parent == NO_BLOCK:  # released (every layer slides): where its prefix still is
                parent = self.pool.hash_to_block.get(hashes[i - 1], NO_BLOCK)
            block = self.pool.blocks[seq.block_table[i]]
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            self.pool.cache(block, h, parent, hashes[i - 1] if i else None, tokens)
            if write_through and block.block_hash == h:
                self.pending_stores.append((block.block_id, h))
            for g in range(1, len(self.windows)):
                block_id = seq.group_tables[g - 1][i]
                if block_id != NO_BLOCK:
                    self.pool.cache(self.pool.blocks[block_id], group_key(h, g), -1, None,
                                    tokens, record=False)  # fmt: skip

    def fork(self, parent: Sequence, child: Sequence) -> None:
        for table in (parent.block_table, *parent.group_tables):
            for block_id in table:
                if block_id != NO_BLOCK:
                    self.pool.touch(self.pool.blocks[block_id])
        child.block_table = list(parent.block_table)
        child.group_tables = [list(t) for t in parent.group_tables]
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens

    def free(self, seq: Sequence, keep_hashes_below: int | None = None) -> None:
        """Release seq's blocks, what is freed first evicted first: a full table tail first (a
        prefix's shared head stays longest), a sliding one head first (the window's last blocks,
        which the chat's next turn hits, stay longest). Blocks from keep_hashes_below on lose
        their hash (their K/V was never written: a failed step)."""
        group0 = (seq.block_table, self.windows[0])  # (no group tables yet: [])
        for table, window in [*zip(seq.group_tables, self.windows[1:], strict=False), group0]:
            order = range(len(table) - 1, -1, -1) if window is None else range(len(table))
            for i in order:
                if table[i] == NO_BLOCK:
                    continue
                block = self.pool.blocks[table[i]]
                if (keep_hashes_below is not None and i >= keep_hashes_below
                        and block.ref_count == 1):  # fmt: skip
                    self.pool.uncache(block)
                self.pool.free(block)
        seq.block_table = []
        seq.group_tables = []
        seq.num_computed_tokens = 0
