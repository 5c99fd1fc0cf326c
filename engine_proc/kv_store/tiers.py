"""KV tiers below the engine's pool: a host tier (engine_proc/kv_store/host.py) and a disk tier
that outlives the process (engine_proc/kv_store/disk.py), keyed by the prefix-hash chain. An entry
is a block's values and, for a quantised cache, its per-block scales
(engine_proc/kv_store/entry.py).

Policy (write-back, the default): a cached block evicted from the pool is copied down into every
enabled lower tier that lacks it; `write_through=True` also stores each block as soon as the step
that fills it has run. Each tier evicts by LRU. A prefix lookup walks pool -> host -> disk
(KVCacheManager.find_cached_prefix); a lower-tier hit is copied into a freshly allocated pool
block, after which it is an ordinary cached block. Loads are synchronous inside the scheduler
step (the requesting sequence waits; on CPU there is nothing to overlap with), and one block is
loaded at most once: it is only loaded when the pool does not hold its hash.

Entries of engines whose K/V differ never mix: the disk header carries the root of the hash
chain, which names the model and its revision, dtype, KV dtype and block size (LLMEngine's
cache_identity), and every block hash descends from it.

KV events (engine_proc/core/kv_events.py): each tier publishes BlockStored (with the parent hash and
tokens it keeps beside each entry), BlockRemoved (LRU eviction, a corrupt disk entry forgotten)
and AllBlocksCleared under its own medium, `host` or `disk`, into the pool's event log.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from pathlib import Path

import torch

from engine_proc.core.kv_events import NO_LINK, BlockStored, ChainLink, KVEventLog
from engine_proc.kv_store.disk import DiskTier
from engine_proc.kv_store.entry import BlockLayout
from engine_proc.kv_store.host import HostTier

_FINGERPRINT_SAMPLE = 1 << 16
_WEIGHT_SUFFIXES = (".gguf", ".safetensors", ".bin", ".json")


def model_fingerprint(model_id: str) -> str:
    """A revision stamp of the weights behind model_id (a path, when it names one): sha256 over
    each weight/config file's name, size and its first and last 64 KiB. Deterministic across
    processes and copies of the files; a re-exported checkpoint gets a new stamp."""
    h = hashlib.sha256(b"kvscope-model-fingerprint-v1\0")
    path = Path(model_id)
    files: list[Path] = []
    try:
        if path.is_dir():
            files = sorted(p for p in path.iterdir() if p.suffix in _WEIGHT_SUFFIXES)
        elif path.is_file():
            files = [path]
    except OSError:
        files = []
    h.update(model_id.encode() if not files else b"")
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}\0{size}\0".encode())
        with f.open("rb") as fh:
            h.update(fh.read(_FINGERPRINT_SAMPLE))
            if size > _FINGERPRINT_SAMPLE:
                fh.seek(max(_FINGERPRINT_SAMPLE, size - _FINGERPRINT_SAMPLE))
                h.update(fh.read(_FINGERPRINT_SAMPLE))
    return h.hexdigest()[:16]


class KVTiers:
    """The lower tiers of one engine's KV pool and the copies between them and the pool."""

    def __init__(
        self,
        kv_cache: torch.Tensor,  # [layers, 2, blocks, block_size, kv_heads, head_dim]
        identity: bytes,
        host_bytes: int = 0,
        disk_dir: str | None = None,
        disk_bytes: int = 0,
        write_through: bool = False,
        kv_scales: torch.Tensor | None = None,  # per-block scales beside the pool (int8 KV)
    ) -> None:
        self.layout = BlockLayout([kv_cache] if kv_scales is None else [kv_cache, kv_scales])
        self.block_bytes = self.layout.block_bytes
        self.write_through = write_through
        self.host: HostTier | None = None
        self.disk: DiskTier | None = None
        num_host = host_bytes // self.block_bytes
        if host_bytes and num_host < 1:
            raise ValueError(
                f"kv_host_memory must hold at least one block of {self.block_bytes} bytes, "
                f"got {host_bytes}"
            )
        if num_host:
            pin = kv_cache.device.type == "cuda"
            self.host = HostTier(num_host, self.layout.parts, pin)
        if disk_dir is not None:
            self.disk = DiskTier(
                disk_dir, disk_bytes, identity, self.block_bytes, block_size=kv_cache.shape[3]
            )
        # pool block id -> the parent hash and tokens of the block it holds, for the tiers' KV
        # events (KVCacheManager.attach_tiers sets it; without it entries are published as roots)
        self.link_of: Callable[[int], ChainLink] | None = None
        self.loads: dict[bytes, int] = {}  # hash -> times loaded while absent from the pool
        self.queries = 0  # tokens looked up below the pool (external_prefix_cache_queries)
        self.hit_tokens = 0  # tokens loaded from below the pool (external_prefix_cache_hits)

    @property
    def enabled(self) -> bool:
        return self.host is not None or self.disk is not None

    def contains(self, block_hash: bytes) -> bool:
        return (self.host is not None and block_hash in self.host) or (
            self.disk is not None and block_hash in self.disk
        )

    def set_events(self, log: KVEventLog | None) -> None:
        """Record the tiers' KV events into `log` (the pool's), or stop recording (None)."""
        for tier in (self.host, self.disk):
            if tier is not None:
                tier.events = log

    def stored_events(self) -> list[BlockStored]:
        """A BlockStored per entry of every tier (their part of a KV event replay)."""
        out: list[BlockStored] = []
        for tier in (self.host, self.disk):
            if tier is not None:
                out += tier.stored_events()
        return out

    def store(self, block_hash: bytes, block_id: int) -> None:
        """Copy pool block block_id (holding block_hash) into every lower tier lacking it, with
        its parent hash and tokens when link_of is set."""
        need_host = self.host is not None and block_hash not in self.host
        need_disk = self.disk is not None and block_hash not in self.disk and self.disk.writable
        if self.host is not None and not need_host:
            self.host.index.move_to_end(block_hash)
        if not (need_host or need_disk):
            return
        t0 = time.perf_counter()
        block = self.layout.block(block_id)
        link = NO_LINK if self.link_of is None else self.link_of(block_id)
        if need_host:
            assert self.host is not None
            self.host.store(block_hash, block, link)
            self.host.stats.store_seconds += time.perf_counter() - t0
        if need_disk:
            assert self.disk is not None
            t1 = time.perf_counter()
            self.disk.store(block_hash, self.layout.to_bytes(block_id), link)
            self.disk.stats.store_seconds += time.perf_counter() - t1

    def load(self, block_hash: bytes, block_id: int) -> str | None:
        """Copy block_hash from the highest tier holding it into pool block block_id; the tier's
        name, or None for a miss."""
        out = self.layout.block(block_id)
        if self.host is not None:
            t0 = time.perf_counter()
            if self.host.load(block_hash, out):
                self.host.stats.load_seconds += time.perf_counter() - t0
                self._count_load(block_hash)
                return "host"
        if self.disk is not None:
            t0 = time.perf_counter()
            link = self.disk.links.get(block_hash, NO_LINK)
            payload = self.disk.load(block_hash)
            if payload is not None:
                self.layout.from_bytes(payload, block_id)
                self.disk.stats.load_seconds += time.perf_counter() - t0
                if self.host is not None:  # promote: the next reload is a host hit
                    self.host.store(block_hash, out, link)
                self._count_load(block_hash)
                return "disk"
        return None

    def _count_load(self, block_hash: bytes) -> None:
        self.loads[block_hash] = self.loads.get(block_hash, 0) + 1

    def clear(self) -> None:
        if self.host is not None:
            self.host.clear()
        if self.disk is not None:
            self.disk.clear()

    def check(self) -> None:
        if self.host is not None:
            self.host.check()
        if self.disk is not None:
            self.disk.check()

    def counters(self) -> dict[str, float]:
        """Snapshot counters (vLLM's names for the external-cache queries and hits)."""
        c: dict[str, float] = {
            "external_prefix_cache_queries": self.queries,
            "external_prefix_cache_hits": self.hit_tokens,
        }
        for name, tier in (("host", self.host), ("disk", self.disk)):
            if tier is None:
                continue
            s = tier.stats
            if isinstance(tier, HostTier):
                capacity, used = tier.num_slots, len(tier.index)
                c["kv_host_bytes_total"] = tier.num_slots * tier.entry_bytes
                c["kv_host_bytes_used"] = used * tier.entry_bytes
            else:
                capacity = tier.capacity_bytes // tier.entry_bytes
                used = len(tier.index)
                c["kv_disk_bytes_total"] = tier.capacity_bytes
                c["kv_disk_bytes_used"] = tier.used_bytes
                c["kv_disk_writable"] = float(tier.writable)
                c["kv_disk_corrupt_entries"] = s.misses_corrupt
                c["kv_disk_write_errors"] = s.write_errors
            c[f"kv_{name}_blocks_total"] = capacity
            c[f"kv_{name}_blocks"] = used
            c[f"kv_{name}_hits"] = s.hits
            c[f"kv_{name}_stores"] = s.stores
            c[f"kv_{name}_evictions"] = s.evictions
            c[f"kv_{name}_bytes_loaded"] = s.bytes_read
            c[f"kv_{name}_bytes_stored"] = s.bytes_written
            c[f"kv_{name}_load_seconds"] = s.load_seconds
            c[f"kv_{name}_store_seconds"] = s.store_seconds
        return c
