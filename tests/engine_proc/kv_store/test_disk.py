"""The disk KV tier (engine_proc/kv_store/disk.py): the documented entry header, damaged, foreign
and half-written entries, capacity, a full disk, and the tier's KV events (a restart publishes
the same parents and tokens). The header is checked against an independent parse of its
documented layout."""

from __future__ import annotations

import hashlib
import os
import struct

import pytest

from engine_proc.core.kv_events import BlockRemoved, BlockStored, ChainLink, KVEventLog
from engine_proc.kv_store.disk import DISK_SUFFIX, DiskTier

# magic, format, identity, block hash, parent hash, token count, payload length, link sha256,
# payload sha256: the layout the module docstring documents
DOC_HEADER = "<12sI32s32s32sIQ32s32s"
DOC_HEADER_BYTES = struct.calcsize(DOC_HEADER)


def _identity() -> bytes:
    return hashlib.sha256(b"test identity").digest()


def _h(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def _link(i: int, first: bool = False) -> ChainLink:
    return ChainLink(None if first else _h(i - 1), tuple(range(i, i + 4)))


def test_disk_entry_layout_is_the_documented_header(tmp_path):
    payload = bytes(range(256)) * 4
    disk = DiskTier(str(tmp_path), 10**6, _identity(), len(payload), block_size=4)
    assert disk.entry_bytes == DOC_HEADER_BYTES + 16 + len(payload)
    for i, link in ((1, _link(1)), (2, _link(2, first=True))):
        assert disk.store(_h(i), payload, link)
        raw = (tmp_path / (_h(i).hex() + DISK_SUFFIX)).read_bytes()
        magic, fmt, ident, h, parent, k, n, link_sha, payload_sha = struct.unpack(
            DOC_HEADER, raw[:DOC_HEADER_BYTES]
        )
        assert (magic, fmt, ident, h, k, n) == (b"KVSCOPE-KVB\0", 2, _identity(), _h(i), 4, 1024)
        assert parent == (link.parent_hash or bytes(32))  # zeros: a prompt's first block
        tokens = raw[DOC_HEADER_BYTES : DOC_HEADER_BYTES + 16]
        assert struct.unpack("<4i", tokens) == link.token_ids
        assert link_sha == hashlib.sha256(parent + tokens).digest()
        assert payload_sha == hashlib.sha256(payload).digest()
        assert raw[DOC_HEADER_BYTES + 16 :] == payload
        assert disk.load(_h(i)) == payload
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign", "renamed"])
def test_damaged_or_foreign_disk_entries_are_misses(tmp_path, damage):
    payload = os.urandom(512)
    disk = DiskTier(str(tmp_path), 10**6, _identity(), len(payload))
    disk.store(_h(1), payload)
    path = disk.path(_h(1))
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[200] ^= 0x40
        path.write_bytes(bytes(raw))
    elif damage == "truncate":
        path.write_bytes(bytes(raw[:300]))
    elif damage == "foreign":
        foreign = DiskTier(str(tmp_path / "f"), 10**6, hashlib.sha256(b"other").digest(), 512)
        foreign.store(_h(1), payload)
        path.write_bytes(foreign.path(_h(1)).read_bytes())
    else:  # a valid entry under another block's name
        path.rename(disk.path(_h(2)))
    for fresh in (False, True):  # found by the running tier at load, or by a restart's scan
        tier = DiskTier(str(tmp_path), 10**6, _identity(), len(payload)) if fresh else disk
        assert tier.load(_h(1)) is None and tier.load(_h(2)) is None
        tier.check()
    if damage in ("flip", "truncate"):
        assert not path.exists()  # a broken entry of ours is removed
    if damage == "foreign":
        assert path.exists()  # another engine's entry is left alone


def test_a_crash_mid_write_leaves_no_entry(tmp_path):
    payload = os.urandom(256)
    disk = DiskTier(str(tmp_path), 10**6, _identity(), len(payload))
    disk.store(_h(1), payload)
    good = disk.path(_h(1)).read_bytes()
    # What a writer killed before its rename leaves: a temp file, possibly complete.
    (tmp_path / f".tmp-{_h(2).hex()}-123-1").write_bytes(good[:100])
    (tmp_path / f".tmp-{_h(3).hex()}-123-2").write_bytes(good)
    again = DiskTier(str(tmp_path), 10**6, _identity(), len(payload))
    assert list(again.index) == [_h(1)]
    assert again.load(_h(2)) is None and again.load(_h(3)) is None


def test_disk_capacity_is_lru_and_a_full_disk_stops_writes_not_reads(tmp_path, monkeypatch):
    payload = os.urandom(100)
    entry = DOC_HEADER_BYTES + 100
    disk = DiskTier(str(tmp_path), 2 * entry, _identity(), 100)
    for i in range(3):
        assert disk.store(_h(i), payload)
    assert list(disk.index) == [_h(1), _h(2)] and not disk.path(_h(0)).exists()
    disk.check()

    def full(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    assert not disk.store(_h(9), payload)
    monkeypatch.undo()
    assert not disk.writable and disk.stats.write_errors == 1
    assert not disk.store(_h(10), payload)  # writes stay stopped
    assert disk.load(_h(2)) == payload  # serving from what is there goes on
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    disk.check()


def _events(log: KVEventLog) -> list[tuple]:
    out = []
    for e in log.drain()[0]:
        if isinstance(e, BlockStored):
            out.append(("stored", e.block_hash, e.parent_block_hash, tuple(e.token_ids), e.medium))
        elif isinstance(e, BlockRemoved):
            out.append(("removed", e.block_hash, e.medium))
        else:
            out.append(("cleared", e.medium))
    return out


def test_disk_events_name_parents_and_survive_a_restart(tmp_path):
    payload = os.urandom(64)
    entry = DOC_HEADER_BYTES + 16 + 64
    disk = DiskTier(str(tmp_path), 2 * entry, _identity(), 64, block_size=4)
    disk.events = log = KVEventLog()
    for i in range(3):  # the third evicts the first, the least recently used
        disk.store(_h(i), payload, _link(i, first=i == 0))
    assert _events(log) == [
        ("stored", _h(0), None, (0, 1, 2, 3), "disk"),
        ("stored", _h(1), _h(0), (1, 2, 3, 4), "disk"),
        ("removed", _h(0), "disk"),
        ("stored", _h(2), _h(1), (2, 3, 4, 5), "disk"),
    ]
    # A restarted tier knows each entry's parent and tokens from its file.
    again = DiskTier(str(tmp_path), 2 * entry, _identity(), 64, block_size=4)
    stored = {
        e.block_hash: (e.parent_block_hash, tuple(e.token_ids)) for e in again.stored_events()
    }
    assert stored == {_h(1): (_h(0), (1, 2, 3, 4)), _h(2): (_h(1), (2, 3, 4, 5))}
    # A damaged entry is forgotten at load, a clear is one event.
    again.events = log
    raw = bytearray(again.path(_h(1)).read_bytes())
    raw[-1] ^= 1
    again.path(_h(1)).write_bytes(bytes(raw))
    assert again.load(_h(1)) is None
    again.clear()
    assert _events(log) == [("removed", _h(1), "disk"), ("cleared", "disk")]
    assert not again.stored_events()


def test_a_damaged_link_is_caught_at_start_up(tmp_path):
    """The scan checks the parent hash and tokens it publishes, not only a load."""
    payload = os.urandom(64)
    disk = DiskTier(str(tmp_path), 10**6, _identity(), 64, block_size=4)
    disk.store(_h(1), payload, _link(1))
    path = disk.path(_h(1))
    raw = bytearray(path.read_bytes())
    raw[DOC_HEADER_BYTES] ^= 1  # a token id
    path.write_bytes(bytes(raw))
    again = DiskTier(str(tmp_path), 10**6, _identity(), 64, block_size=4)
    assert not again.index and not path.exists() and again.stats.misses_corrupt == 1
