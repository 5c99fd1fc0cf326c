"""The disk KV tier: one file per entry (engine_proc/kv_store/entry.py) that outlives the process.

Entries are `<block hash hex>.kvb` files written atomically (temp file, fsync, rename, fsync of the
directory): a header naming the format, the engine's cache identity (the root of its hash chain:
model and revision, dtype, KV dtype, block size), the block hash, its parent's hash (zeros: a
prompt's first block), the number of token ids, the payload length, the sha256 of the parent hash
and token ids (the link) and the sha256 of the payload; then the block's token ids (int32,
little-endian), then the payload: the entry's parts (values, then per-block scales when the cache
has them). The link is what the tier's KV events name (engine_proc/core/kv_events.py), so a
restarted engine publishes its disk entries as the same tree: the start-up scan checks the link's
checksum (cheap), a load checks both. A truncated, corrupt, older-format or foreign entry is a miss
(logged, and the file is removed when it claims our identity); a failed write (disk full) stops disk
writes, not serving. """

from __future__ import annotations

import errno
import hashlib
import logging
import os
import struct
import time
from collections import OrderedDict
from pathlib import Path
from typing import BinaryIO

from engine_proc.core.kv_events import (
    DISK,
    NO_LINK,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ChainLink,
    KVEventLog,
    tier_stored,
)
from engine_proc.kv_store.entry import TierStats

logger = logging.getLogger(__name__)

DISK_MAGIC = b"KVSCOPE-KVB\0"
DISK_FORMAT = 2  # 1: no parent hash or tokens
# magic, format, identity digest, block hash, parent hash, token count, payload bytes,
# sha256(parent hash + token ids), sha256(payload)
HEADER = struct.Struct("<12sI32s32s32sIQ32s32s")
NO_PARENT = bytes(32)
_IDENTITY = slice(16, 48)  # where every format so far keeps the identity digest
MAX_TOKENS = 1 << 16  # a sanity bound on a header's token count
DISK_SUFFIX = ".kvb"
_TMP_PREFIX = ".tmp-"
_STALE_TMP_SECONDS = 3600.0


class DiskTier:
    """One file per block in `directory`, an in-memory LRU index rebuilt from the files at
    start-up (oldest modification first), at most `capacity_bytes` of entries."""

    def __init__(self, directory: str, capacity_bytes: int, identity: bytes,
                 payload_bytes: int, block_size: int = 0) -> None:  # fmt: skip
        assert len(identity) == 32
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.identity = identity
        self.payload_bytes = payload_bytes
        self.entry_bytes = _file_bytes(block_size, payload_bytes)  # a full block's file
        self.index: OrderedDict[bytes, int] = OrderedDict()  # hash -> file bytes, LRU first
        self.links: dict[bytes, ChainLink] = {}  # same keys as index
        self.events: KVEventLog | None = None  # shared with the pool once events are on
        self.used_bytes = 0
        self.writable = True
        self.stats = TierStats()
        self._tmp_counter = 0
        self._scan()

    def path(self, block_hash: bytes) -> Path:
        return self.dir / (block_hash.hex() + DISK_SUFFIX)

    def _scan(self) -> None:
        found: list[tuple[int, bytes, int, ChainLink]] = []
        now = time.time()
        for entry in os.scandir(self.dir):
            try:
                item = self._scan_entry(entry, now)
            except (OSError, ValueError):
                continue
            if item is not None:
                found.append(item)
        for _, block_hash, size, link in sorted(found, key=lambda f: f[:2]):
            self.index[block_hash] = size
            self.links[block_hash] = link
            self.used_bytes += size
        self._evict_to(self.capacity_bytes)
        logger.info("KV disk tier %s: %d entries, %.1f MiB", self.dir, len(self.index),
                    self.used_bytes / 2**20)  # fmt: skip

    def _scan_entry(
        self, entry: os.DirEntry[str], now: float
    ) -> tuple[int, bytes, int, ChainLink] | None:
        """(mtime, hash, file bytes, link) of one usable entry file; None for anything else."""
        name = entry.name
        if name.startswith(_TMP_PREFIX):  # a crash mid-write: never an entry
            if now - entry.stat().st_mtime > _STALE_TMP_SECONDS:
                os.unlink(entry.path)
            return None
        if not name.endswith(DISK_SUFFIX):
            return None
        block_hash = bytes.fromhex(name[: -len(DISK_SUFFIX)])
        st = entry.stat()
        with open(entry.path, "rb") as fh:
            header = fh.read(HEADER.size)
            ok = len(block_hash) == 32 and self._header_ok(header, block_hash, st.st_size)
            link = _read_link(fh, header) if ok else None
        if link is None:
            if header[_IDENTITY] == self.identity:
                logger.warning("KV disk entry %s is truncated, corrupt or of an older format: "
                               "removed", name)  # fmt: skip
                self.stats.misses_corrupt += 1
                _unlink_quietly(Path(entry.path))
            return None  # another model's: not ours to use
        return st.st_mtime_ns, block_hash, st.st_size, link

    def _header_ok(self, header: bytes, block_hash: bytes, file_size: int) -> bool:
        if len(header) != HEADER.size:
            return False
        magic, fmt, identity, h, _, num_tokens, n, _, _ = HEADER.unpack(header)
        return (
            magic == DISK_MAGIC
            and fmt == DISK_FORMAT
            and identity == self.identity
            and h == block_hash
            and n == self.payload_bytes
            and num_tokens <= MAX_TOKENS
            and file_size == HEADER.size + 4 * num_tokens + n
        )

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.index

    def store(self, block_hash: bytes, payload: bytes, link: ChainLink = NO_LINK) -> bool:
        if block_hash in self.index:
            self.index.move_to_end(block_hash)
            return True
        size = _file_bytes(len(link.token_ids), len(payload))
        if not self.writable or size > self.capacity_bytes:
            return False
        self._evict_to(self.capacity_bytes - size)
        assert len(payload) == self.payload_bytes and len(link.token_ids) <= MAX_TOKENS
        parent = link.parent_hash or NO_PARENT
        tokens = struct.pack(f"<{len(link.token_ids)}i", *link.token_ids)
        header = HEADER.pack(DISK_MAGIC, DISK_FORMAT, self.identity, block_hash, parent,
                             len(link.token_ids), len(payload), _sha(parent + tokens),
                             _sha(payload))  # fmt: skip
        self._tmp_counter += 1
        tmp = self.dir / f"{_TMP_PREFIX}{block_hash.hex()}-{os.getpid()}-{self._tmp_counter}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                view = memoryview(header + tokens + payload)
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
        self.index[block_hash] = size
        self.links[block_hash] = link
        self.used_bytes += size
        self.stats.stores += 1
        self.stats.bytes_written += size
        if self.events is not None:
            self.events.append(tier_stored(block_hash, link, DISK))
        return True

    def load(self, block_hash: bytes) -> bytes | None:
        """The payload, or None for a miss (absent, truncated, corrupt, foreign)."""
        size = self.index.get(block_hash)
        if size is None:
            return None
        path = self.path(block_hash)
        try:
            with open(path, "rb") as fh:
                data = fh.read(size + 1)
        except OSError as exc:
            logger.warning("KV disk entry %s unreadable (%s): a miss", path.name, exc)
            self._forget(block_hash, unlink=False)
            return None
        header = data[: HEADER.size]
        ok = self._header_ok(header, block_hash, len(data))
        if ok:
            _, _, _, _, parent, num_tokens, _, link_sha, payload_sha = HEADER.unpack(header)
            split = HEADER.size + 4 * num_tokens
            ok = _sha(parent + data[HEADER.size : split]) == link_sha
            ok = ok and _sha(data[split:]) == payload_sha
        if not ok:
            logger.warning("KV disk entry %s is truncated, corrupt or foreign: a miss", path.name)
            self.stats.misses_corrupt += 1
            # A truncated or damaged entry of ours goes; another engine's is left alone.
            ours = len(header) < _IDENTITY.stop or header[_IDENTITY] == self.identity
            self._forget(block_hash, unlink=ours)
            return None
        payload = data[len(data) - self.payload_bytes :]
        self.index.move_to_end(block_hash)
        self.stats.hits += 1
        self.stats.bytes_read += len(data)
        try:
            os.utime(path)  # LRU order survives a restart
        except OSError:
            pass
        return payload

    def _forget(self, block_hash: bytes, unlink: bool, quiet: bool = False) -> None:
        size = self.index.pop(block_hash, None)
        if size is not None:
            self.used_bytes -= size
            del self.links[block_hash]
            if self.events is not None and not quiet:
                self.events.append(BlockRemoved(block_hash, DISK))
        if unlink:
            _unlink_quietly(self.path(block_hash))

    def _evict_to(self, limit: int) -> None:
        while self.index and self.used_bytes > limit:
            block_hash = next(iter(self.index))
            self._forget(block_hash, unlink=True)
            self.stats.evictions += 1

    def clear(self) -> None:
        for block_hash in list(self.index):
            self._forget(block_hash, unlink=True, quiet=True)
        if self.events is not None:
            self.events.append(AllBlocksCleared(DISK))

    def stored_events(self) -> list[BlockStored]:
        """A BlockStored per entry (the disk tier's part of a replay)."""
        return [tier_stored(h, self.links[h], DISK) for h in self.index]

    def check(self) -> None:
        """Every indexed entry has its file, and every file that claims this engine's identity
        is indexed."""
        claimed = set()
        for p in self.dir.iterdir():
            if p.name.endswith(DISK_SUFFIX):
                with p.open("rb") as fh:
                    header = fh.read(HEADER.size)
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
        assert self.links.keys() == self.index.keys(), "disk tier links differ from its index"


def _file_bytes(num_tokens: int, payload_bytes: int) -> int:
    return HEADER.size + 4 * num_tokens + payload_bytes


def _read_link(fh: BinaryIO, header: bytes) -> ChainLink | None:
    """The parent hash and token ids after a header _header_ok accepted; None when they do not
    match their checksum."""
    _, _, _, _, parent, num_tokens, _, link_sha, _ = HEADER.unpack(header)
    raw = fh.read(4 * num_tokens)
    if len(raw) != 4 * num_tokens or _sha(parent + raw) != link_sha:
        return None
    tokens = struct.unpack(f"<{num_tokens}i", raw)
    return ChainLink(None if parent == NO_PARENT else parent, tokens)


def _sha(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


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
