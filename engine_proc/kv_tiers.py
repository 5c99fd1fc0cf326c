"""KV tiers below the engine's pool: a host tier (a second, compact pool tensor; pinned on CUDA)
and a disk tier (one file per block that outlives the process), keyed by the prefix-hash chain.

Policy (write-back, the default): a cached block evicted from the pool is copied down into every
enabled lower tier that lacks it; `write_through=True` also stores each block as soon as the step
that fills it has run. Each tier evicts by LRU. A prefix lookup walks pool -> host -> disk
(KVCacheManager.find_cached_prefix); a lower-tier hit is copied into a freshly allocated pool
block, after which it is an ordinary cached block. Loads are synchronous inside the scheduler
step (the requesting sequence waits; on CPU there is nothing to overlap with), and one block is
loaded at most once: it is only loaded when the pool does not hold its hash.

Disk entries are `<block hash hex>.kvb` files written atomically (temp file, fsync, rename, fsync
of the directory) with a header naming the format, the engine's cache identity (the root of its
hash chain: model and revision, dtype, KV dtype, block size), the block hash, the payload length
and the payload's sha256. A truncated, corrupt or foreign entry is a miss (logged, and the file is
removed when it claims our identity); a failed write (disk full) stops disk writes, not serving.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

DISK_MAGIC = b"KVSCOPE-KVB\0"
DISK_FORMAT = 1
# magic, format, identity digest, block hash, payload bytes, payload sha256
_HEADER = struct.Struct("<12sI32s32sQ32s")
DISK_SUFFIX = ".kvb"
_TMP_PREFIX = ".tmp-"
_STALE_TMP_SECONDS = 3600.0
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


@dataclass(slots=True)
class TierStats:
    hits: int = 0  # blocks loaded from this tier into the pool
    stores: int = 0  # blocks written into this tier
    evictions: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    load_seconds: float = 0.0
    store_seconds: float = 0.0
    misses_corrupt: int = 0  # entries found but rejected (checksum, truncated, foreign)
    write_errors: int = 0


class HostTier:
    """A compact pool of whole blocks ([slots, layers, 2, block_size, kv_heads, head_dim]) with
    an LRU index hash -> slot."""

    def __init__(self, num_slots: int, block_shape: tuple[int, ...], dtype: torch.dtype,
                 pin: bool) -> None:  # fmt: skip
        assert num_slots > 0
        self.num_slots = num_slots
        self.data = torch.empty((num_slots, *block_shape), dtype=dtype, pin_memory=pin)
        self.index: OrderedDict[bytes, int] = OrderedDict()  # LRU first
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.stats = TierStats()

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.index

    def store(self, block_hash: bytes, block: torch.Tensor) -> None:
        if block_hash in self.index:
            self.index.move_to_end(block_hash)
            return
        if not self.free_slots:
            _, slot = self.index.popitem(last=False)
            self.free_slots.append(slot)
            self.stats.evictions += 1
        slot = self.free_slots.pop()
        self.data[slot].copy_(block)
        self.index[block_hash] = slot
        self.stats.stores += 1
        self.stats.bytes_written += block.numel() * block.element_size()

    def load(self, block_hash: bytes, out: torch.Tensor) -> bool:
        slot = self.index.get(block_hash)
        if slot is None:
            return False
        out.copy_(self.data[slot])
        self.index.move_to_end(block_hash)
        self.stats.hits += 1
        self.stats.bytes_read += out.numel() * out.element_size()
        return True

    def clear(self) -> None:
        self.free_slots.extend(self.index.values())
        self.index.clear()

    def check(self) -> None:
        slots = list(self.index.values()) + self.free_slots
        assert sorted(slots) == list(range(self.num_slots)), "host tier slots leaked or shared"


class DiskTier:
    """One file per block in `directory`, an in-memory LRU index rebuilt from the files at
    start-up (oldest modification first), at most `capacity_bytes` of entries."""

    def __init__(self, directory: str, capacity_bytes: int, identity: bytes,
                 payload_bytes: int) -> None:  # fmt: skip
        assert len(identity) == 32
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.identity = identity
        self.payload_bytes = payload_bytes
        self.entry_bytes = _HEADER.size + payload_bytes
        self.index: OrderedDict[bytes, int] = OrderedDict()  # hash -> file bytes, LRU first
        self.used_bytes = 0
        self.writable = True
        self.stats = TierStats()
        self._tmp_counter = 0
        self._scan()

    def path(self, block_hash: bytes) -> Path:
        return self.dir / (block_hash.hex() + DISK_SUFFIX)

    def _scan(self) -> None:
        found: list[tuple[int, bytes, int]] = []
        now = time.time()
        for entry in os.scandir(self.dir):
            name = entry.name
            try:
                if name.startswith(_TMP_PREFIX):  # a crash mid-write: never an entry
                    if now - entry.stat().st_mtime > _STALE_TMP_SECONDS:
                        os.unlink(entry.path)
                    continue
                if not name.endswith(DISK_SUFFIX):
                    continue
                block_hash = bytes.fromhex(name[: -len(DISK_SUFFIX)])
                st = entry.stat()
                with open(entry.path, "rb") as fh:
                    header = fh.read(_HEADER.size)
            except (OSError, ValueError):
                continue
            if len(block_hash) != 32 or not self._header_ok(header, block_hash, st.st_size):
                if len(header) == _HEADER.size and _HEADER.unpack(header)[2] == self.identity:
                    logger.warning("KV disk entry %s is truncated or corrupt: removed", name)
                    self.stats.misses_corrupt += 1
                    _unlink_quietly(Path(entry.path))
                continue  # another model's or another format's: not ours to use
            found.append((st.st_mtime_ns, block_hash, st.st_size))
        for _, block_hash, size in sorted(found):
            self.index[block_hash] = size
            self.used_bytes += size
        self._evict_to(self.capacity_bytes)
        logger.info("KV disk tier %s: %d entries, %.1f MiB", self.dir, len(self.index),
                    self.used_bytes / 2**20)  # fmt: skip

    def _header_ok(self, header: bytes, block_hash: bytes, file_size: int) -> bool:
        if len(header) != _HEADER.size:
            return False
        magic, fmt, identity, h, n, _ = _HEADER.unpack(header)
        return (
            magic == DISK_MAGIC
            and fmt == DISK_FORMAT
            and identity == self.identity
            and h == block_hash
            and n == self.payload_bytes
            and file_size == _HEADER.size + n
        )

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.index

    def store(self, block_hash: bytes, payload: bytes) -> bool:
        if block_hash in self.index:
            self.index.move_to_end(block_hash)
            return True
        if not self.writable or self.entry_bytes > self.capacity_bytes:
            return False
        self._evict_to(self.capacity_bytes - self.entry_bytes)
        assert len(payload) == self.payload_bytes
        header = _HEADER.pack(DISK_MAGIC, DISK_FORMAT, self.identity, block_hash,
                              len(payload), hashlib.sha256(payload).digest())  # fmt: skip
        self._tmp_counter += 1
        tmp = self.dir / f"{_TMP_PREFIX}{block_hash.hex()}-{os.getpid()}-{self._tmp_counter}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.write(fd, header)
                view = memoryview(payload)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path(block_hash))
            _fsync_dir(self.dir)
        except OSError as exc:
            self.stats.write_errors += 1
            _unlink_quietly(tmp)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES):
                self.writable = False  # stop writing; serving goes on from what is there
                logger.warning("KV disk tier %s: writes stopped (%s)", self.dir, exc)
            else:
                logger.warning("KV disk tier %s: write failed (%s)", self.dir, exc)
            return False
        self.index[block_hash] = self.entry_bytes
        self.used_bytes += self.entry_bytes
        self.stats.stores += 1
        self.stats.bytes_written += self.entry_bytes
        return True

    def load(self, block_hash: bytes) -> bytes | None:
        """The payload, or None for a miss (absent, truncated, corrupt, foreign)."""
        if block_hash not in self.index:
            return None
        path = self.path(block_hash)
        try:
            with open(path, "rb") as fh:
                data = fh.read(self.entry_bytes + 1)
        except OSError as exc:
            logger.warning("KV disk entry %s unreadable (%s): a miss", path.name, exc)
            self._forget(block_hash, unlink=False)
            return None
        header, payload = data[: _HEADER.size], data[_HEADER.size :]
        ok = self._header_ok(header, block_hash, len(data))
        if ok and hashlib.sha256(payload).digest() != _HEADER.unpack(header)[5]:
            ok = False
        if not ok:
            logger.warning("KV disk entry %s is truncated, corrupt or foreign: a miss", path.name)
            self.stats.misses_corrupt += 1
            # A truncated or damaged entry of ours goes; another engine's is left alone.
            ours = len(header) < _HEADER.size or _HEADER.unpack(header)[2] == self.identity
            self._forget(block_hash, unlink=ours)
            return None
        self.index.move_to_end(block_hash)
        self.stats.hits += 1
        self.stats.bytes_read += len(data)
        try:
            os.utime(path)  # LRU order survives a restart
        except OSError:
            pass
        return payload

    def _forget(self, block_hash: bytes, unlink: bool) -> None:
        size = self.index.pop(block_hash, None)
        if size is not None:
            self.used_bytes -= size
        if unlink:
            _unlink_quietly(self.path(block_hash))

    def _evict_to(self, limit: int) -> None:
        while self.index and self.used_bytes > limit:
            block_hash = next(iter(self.index))
            self._forget(block_hash, unlink=True)
            self.stats.evictions += 1

    def clear(self) -> None:
        for block_hash in list(self.index):
            self._forget(block_hash, unlink=True)

    def check(self) -> None:
        """Every indexed entry has its file, and every file that claims this engine's identity
        is indexed."""
        claimed = set()
        for p in self.dir.iterdir():
            if p.name.endswith(DISK_SUFFIX):
                with p.open("rb") as fh:
                    header = fh.read(_HEADER.size)
                try:
                    named = bytes.fromhex(p.name[: -len(DISK_SUFFIX)])
                except ValueError:
                    continue
                if self._header_ok(header, named, p.stat().st_size):
                    claimed.add(p.name)
        ours = {self.path(h).name for h in self.index}
        # An entry damaged after it was indexed stays indexed until a load rejects it.
        missing = {n for n in ours if not (self.dir / n).exists()}
        assert not missing and claimed <= ours, f"disk index differs from the files: {missing}"
        assert self.used_bytes == sum(self.index.values()) <= max(self.capacity_bytes, 0)


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
    ) -> None:
        self.kv_cache = kv_cache
        self.block_shape = (kv_cache.shape[0], 2, *kv_cache.shape[3:])
        self.block_bytes = kv_cache[:, :, 0].numel() * kv_cache.element_size()
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
            self.host = HostTier(num_host, self.block_shape, kv_cache.dtype, pin)
        if disk_dir is not None:
            self.disk = DiskTier(disk_dir, disk_bytes, identity, self.block_bytes)
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

    def store(self, block_hash: bytes, block_id: int) -> None:
        """Copy pool block block_id (holding block_hash) into every lower tier lacking it."""
        need_host = self.host is not None and block_hash not in self.host
        need_disk = self.disk is not None and block_hash not in self.disk and self.disk.writable
        if self.host is not None and not need_host:
            self.host.index.move_to_end(block_hash)
        if not (need_host or need_disk):
            return
        t0 = time.perf_counter()
        block = self.kv_cache[:, :, block_id]
        if need_host:
            assert self.host is not None
            self.host.store(block_hash, block)
            self.host.stats.store_seconds += time.perf_counter() - t0
        if need_disk:
            assert self.disk is not None
            t1 = time.perf_counter()
            self.disk.store(block_hash, _to_bytes(block))
            self.disk.stats.store_seconds += time.perf_counter() - t1

    def load(self, block_hash: bytes, block_id: int) -> str | None:
        """Copy block_hash from the highest tier holding it into pool block block_id; the tier's
        name, or None for a miss."""
        out = self.kv_cache[:, :, block_id]
        if self.host is not None:
            t0 = time.perf_counter()
            if self.host.load(block_hash, out):
                self.host.stats.load_seconds += time.perf_counter() - t0
                self._count_load(block_hash)
                return "host"
        if self.disk is not None:
            t0 = time.perf_counter()
            payload = self.disk.load(block_hash)
            if payload is not None:
                out.copy_(_from_bytes(payload, out))
                self.disk.stats.load_seconds += time.perf_counter() - t0
                if self.host is not None:  # promote: the next reload is a host hit
                    self.host.store(block_hash, out)
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
                c["kv_host_bytes_total"] = tier.num_slots * self.block_bytes
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


def _to_bytes(block: torch.Tensor) -> bytes:
    return block.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def _from_bytes(payload: bytes, like: torch.Tensor) -> torch.Tensor:
    flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return flat.view(like.dtype).view(like.shape)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
