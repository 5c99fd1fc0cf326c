"""The engine's half of prefill/decode disaggregation, without sockets (those are in
engine_proc/kv_transfer/service.py).

Prefill side: a request sent with `do_remote_decode` keeps its prompt's full KV blocks under a
*lease* when it finishes (one reference per block, so neither eviction nor reuse can touch them)
until a decode engine pulls them or the lease runs out.

Decode side: pulled block payloads are *adopted* into the pool and its prefix index, in chain
order, exactly as a block loaded from a lower KV tier: each becomes a cached block under its own
chain hash (computed here from the tokens, never trusted from the wire), held by the request until
the scheduler admits it, so the ordinary prefix-cache lookup at admission finds them.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from engine_proc.core.block_pool import BlockPool, KVBlock
from engine_proc.core.kv_cache_manager import KVCacheManager
from engine_proc.core.request import Sequence
from engine_proc.kv_store.entry import BlockLayout

log = logging.getLogger(__name__)

DEFAULT_LEASE_SECONDS = 30.0


@dataclass(slots=True)
class KVTransferRequest:
    """What add_request receives for a disaggregated request."""

    do_remote_decode: bool = False  # prefill role: lease the prompt's blocks at the end
    output_token_ids: list[int] = field(default_factory=list)  # decode role: already generated
    payloads: dict[bytes, bytes] = field(default_factory=dict)  # decode role: pulled blocks


@dataclass(slots=True)
class Lease:
    lease_id: str
    block_hashes: list[bytes]
    blocks: list[KVBlock]
    expires: float


@dataclass(slots=True)
class TransferStats:
    leases_granted: int = 0
    leases_pulled: int = 0
    leases_expired: int = 0
    blocks_sent: int = 0
    bytes_sent: int = 0
    blocks_adopted: int = 0  # decode side: pulled blocks written into the pool
    blocks_already_cached: int = 0  # decode side: prompt blocks the pool had (not pulled)

    def counters(self) -> dict[str, float]:
        return {f"kv_transfer_{k}": float(getattr(self, k)) for k in self.__slots__}


class KVLeases:
    """Prompt blocks held for a decode engine to pull, by lease id.

    Two threads use it: the engine loop (hold, expire, collect: everything that touches the
    block pool) and the transfer server's thread (payloads, take: reads of leased blocks, which
    no one writes while the lease holds them). `lock` guards the lease table, and a read of a
    lease's blocks holds it, so a lease cannot expire (and its blocks be reused) mid-read. A
    lease ended by its pull leaves the table at once; its blocks go back to the pool at the
    loop's next collect()."""

    def __init__(self, pool: BlockPool, lease_seconds: float = DEFAULT_LEASE_SECONDS) -> None:
        if not lease_seconds > 0:
            raise ValueError(f"kv_lease_seconds must be > 0, got {lease_seconds!r}")
        self.pool = pool
        self.lease_seconds = lease_seconds
        self.leases: dict[str, Lease] = {}
        self.stats = TransferStats()
        self.lock = threading.Lock()
        self._taken: list[Lease] = []  # pulled, not yet back in the pool (collect() frees them)

    def hold(self, hashes: list[bytes], block_ids: list[int], now: float) -> Lease:
        assert len(hashes) == len(block_ids)
        blocks = [self.pool.blocks[b] for b in block_ids]
        for block in blocks:
            self.pool.touch(block)
        lease = Lease(secrets.token_hex(8), list(hashes), blocks, now + self.lease_seconds)
        with self.lock:
            self.leases[lease.lease_id] = lease
            self.stats.leases_granted += 1
        return lease

    def holds(self, lease_id: str) -> bool:
        with self.lock:
            return lease_id in self.leases

    def payloads(
        self, lease_id: str, hashes: list[bytes], to_bytes: Callable[[int], bytes]
    ) -> list[bytes]:
        """The bytes of the asked blocks; KeyError naming what the lease does not hold."""
        with self.lock:
            lease = self.leases.get(lease_id)
            if lease is None:
                raise KeyError(f"lease {lease_id!r} is unknown, already pulled or expired")
            by_hash = dict(zip(lease.block_hashes, lease.blocks, strict=True))
            missing = [h for h in hashes if h not in by_hash]
            if missing:
                raise KeyError(f"lease {lease_id!r} holds no block {missing[0].hex()[:16]}")
            out = [to_bytes(by_hash[h].block_id) for h in hashes]
            self.stats.blocks_sent += len(out)
            self.stats.bytes_sent += sum(len(p) for p in out)
        return out

    def take(self, lease_id: str) -> bool:
        """End a lease that was pulled (any thread); its blocks return at collect()."""
        with self.lock:
            lease = self.leases.pop(lease_id, None)
            if lease is None:
                return False
            self._taken.append(lease)
            self.stats.leases_pulled += 1
        return True

    def collect(self) -> int:
        """Engine loop: give the blocks of pulled leases back to the pool."""
        with self.lock:
            taken, self._taken = self._taken, []
        for lease in taken:
            self._free(lease)
        return len(taken)

    def release(self, lease_id: str, pulled: bool = True) -> bool:
        """Engine loop: end a lease now."""
        with self.lock:
            lease = self.leases.pop(lease_id, None)
            if lease is None:
                return False
            if pulled:
                self.stats.leases_pulled += 1
        self._free(lease)
        return True

    def _free(self, lease: Lease) -> None:
        for block in reversed(lease.blocks):  # tail first: evicted first
            self.pool.free(block)

    def expire(self, now: float) -> int:
        with self.lock:
            old = [lid for lid, lease in self.leases.items() if lease.expires <= now]
        n = 0
        for lid in old:
            if self.release(lid, pulled=False):  # not pulled meanwhile
                log.info("KV lease %s expired before a decode engine pulled it", lid)
                n += 1
        with self.lock:
            self.stats.leases_expired += n
        return n

    def release_all(self) -> None:
        self.collect()
        with self.lock:
            ids = list(self.leases)
        for lid in ids:
            self.release(lid, pulled=False)


def missing_blocks(pool: BlockPool, hashes: list[bytes]) -> list[bytes]:
    """The hashes of a prompt chain the pool cannot serve, from the first gap on (a prefix hit
    stops at the first gap, so later blocks the pool happens to hold are pulled too only when
    they follow a gap: they are kept, never written twice, at adoption)."""
    for i, h in enumerate(hashes):
        if pool.lookup(h) is None:
            return hashes[i:]
    return []


def adopt_blocks(
    pool: BlockPool,
    hashes: list[bytes],
    tokens_of: Callable[[int], tuple[int, ...]],
    payloads: dict[bytes, bytes],
    write: Callable[[bytes, int], None],
    stats: TransferStats,
    reserve: int,
) -> list[KVBlock]:
    """Walk a prompt's chain: take a reference on every block the pool has, write pulled
    payloads into fresh blocks for those it lacks, stop at the first block neither has or when
    only `reserve` free blocks are left (what the request needs beyond its prompt's full
    blocks: holding those too could leave it waiting forever for room it holds itself).
    Returns the held blocks, chain order; the caller frees them."""
    held: list[KVBlock] = []
    for i, h in enumerate(hashes):
        block = pool.lookup(h)
        if block is not None:
            pool.touch(block)
            held.append(block)
            stats.blocks_already_cached += 1
            continue
        payload = payloads.get(h)
        if payload is None or pool.num_free <= reserve:
            break
        block = pool.allocate()  # may evict the LRU block; never one of `held`
        write(payload, block.block_id)
        pool.cache(block, h, held[-1].block_id if held else -1, hashes[i - 1] if i else None,
                   tokens_of(i))  # fmt: skip
        held.append(block)
        stats.blocks_adopted += 1
    return held


class KVTransfer:
    """One engine's leases (prefill role) and adoptions (decode role)."""

    def __init__(self, kv: KVCacheManager, layout: BlockLayout) -> None:
        self.kv = kv
        self.layout = layout
        self.leases = KVLeases(kv.pool)
        self.stats = self.leases.stats

    @property
    def block_bytes(self) -> int:
        return self.layout.block_bytes

    def prompt_hashes(self, seq: Sequence) -> list[bytes]:
        """Chain hashes of the prompt's full blocks (what a prefill engine computed)."""
        return self.kv.full_block_hashes(seq, seq.num_prompt_tokens // self.kv.block_size)

    def lease(self, seq: Sequence, now: float) -> tuple[str, list[bytes]]:
        """Hold seq's full prompt blocks (call before its blocks are freed)."""
        hashes = self.prompt_hashes(seq)
        lease = self.leases.hold(hashes, seq.block_table[: len(hashes)], now)
        return lease.lease_id, hashes

    def payloads(self, lease_id: str, hashes: list[bytes]) -> list[bytes]:
        return self.leases.payloads(lease_id, hashes, self.layout.to_bytes)

    def missing(self, hashes: list[bytes]) -> list[bytes]:
        return missing_blocks(self.kv.pool, hashes) if self.kv.enable_caching else []

    def adopt(self, seq: Sequence, payloads: dict[bytes, bytes]) -> list[KVBlock]:
        """Hold the prompt's blocks, writing pulled payloads into the pool for those it lacks.
        Without prefix caching nothing can be found at admission: nothing is adopted."""
        if not self.kv.enable_caching:
            return []
        bs = self.kv.block_size
        hashes = self.prompt_hashes(seq)
        return adopt_blocks(
            self.kv.pool,
            hashes,
            lambda i: tuple(seq.token_ids[i * bs : (i + 1) * bs]),
            payloads,
            self.layout.from_bytes,
            self.stats,
            reserve=self.kv.num_blocks_for(seq.num_tokens) - len(hashes),
        )

    def release_held(self, seq: Sequence) -> None:
        held, seq.held_blocks = seq.held_blocks, []
        for block in reversed(held):
            self.kv.pool.free(block)

    def counters(self) -> dict[str, float]:
        c = self.stats.counters()
        c["kv_transfer_leases_active"] = float(len(self.leases.leases))
        return c
