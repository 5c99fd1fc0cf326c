"""What a lower-tier KV entry holds (engine_proc/kv_store/entry.py) through the host and disk tiers:
whole blocks, an int8 pool's values and scales, an fp8 pool's values alone. References are
independent: numpy's bytes of the pool slices, and clones taken before the copies."""

from __future__ import annotations

import hashlib
import struct

import pytest
import torch

from engine_proc.kv_store.disk import DISK_SUFFIX
from engine_proc.kv_store.entry import PartSpec
from engine_proc.kv_store.host import HostTier
from engine_proc.kv_store.tiers import KVTiers
from tests.engine_proc.kv_store.test_disk import _h, _identity


def test_host_tier_is_lru_and_copies_whole_blocks():
    parts = (PartSpec((2, 2, 3), torch.float32),)
    host = HostTier(2, parts, pin=False)
    blocks = [[torch.full((2, 2, 3), float(i))] for i in range(3)]
    host.store(_h(0), blocks[0])
    host.store(_h(1), blocks[1])
    out = [torch.empty(2, 2, 3)]
    assert host.load(_h(0), out) and torch.equal(out[0], blocks[0][0])  # 0 is now most recent
    host.store(_h(2), blocks[2])  # evicts 1, the least recently used
    assert _h(1) not in host and _h(0) in host and _h(2) in host
    assert not host.load(_h(1), out)
    assert host.load(_h(2), out) and torch.equal(out[0], blocks[2][0])
    assert host.stats.bytes_written == 3 * 2 * 2 * 3 * 4  # three stores of 12 float32 values
    host.check()


def _int8_pool(num_blocks: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A random int8 pool [layers, 2, blocks, block_size, kv_heads, head_dim] and its float16
    scales [layers, 2, blocks, block_size, kv_heads]."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(-127, 128, (2, 2, num_blocks, 4, 2, 8), generator=g, dtype=torch.int8)
    scales = (torch.rand((2, 2, num_blocks, 4, 2), generator=g) + 0.01).to(torch.float16)
    return values, scales


def test_an_int8_entry_is_the_values_then_the_scales(tmp_path):
    values, scales = _int8_pool()
    tiers = KVTiers(values, _identity(), disk_dir=str(tmp_path), disk_bytes=10**6,
                    kv_scales=scales)  # fmt: skip
    # Hand count: 2 layers * K/V * 4 tokens * 2 heads * (8 int8 values + one 2-byte scale).
    assert tiers.block_bytes == 2 * 2 * 4 * 2 * (8 + 2)
    tiers.store(_h(1), 1)
    raw = (tmp_path / (_h(1).hex() + DISK_SUFFIX)).read_bytes()
    # Independent layout: numpy's C-order bytes of block 1's values, then of its scales.
    expected = values[:, :, 1].numpy().tobytes() + scales[:, :, 1].numpy().tobytes()
    # the disk header (format 2): no parent hash or tokens given here, so none follow it
    fields = struct.unpack("<12sI32s32s32sIQ32s32s", raw[:188])
    ident, h, k, n, digest = fields[2], fields[3], fields[5], fields[6], fields[8]
    assert (ident, h, k, n) == (_identity(), _h(1), 0, len(expected))
    assert raw[188:] == expected and digest == hashlib.sha256(expected).digest()


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_an_int8_block_comes_back_with_its_scales(tmp_path, tier):
    values, scales = _int8_pool()
    want_values, want_scales = values[:, :, 0].clone(), scales[:, :, 0].clone()
    other_values, other_scales = values[:, :, 2].clone(), scales[:, :, 2].clone()
    kw = dict(host_bytes=320) if tier == "host" else dict(disk_dir=str(tmp_path),
                                                          disk_bytes=10**6)
    tiers = KVTiers(values, _identity(), kv_scales=scales, **kw)
    tiers.store(_h(0), 0)
    values[:, :, 1].zero_()
    scales[:, :, 1].zero_()
    assert tiers.load(_h(0), 1) == tier
    assert torch.equal(values[:, :, 1], want_values) and torch.equal(scales[:, :, 1], want_scales)
    assert torch.equal(values[:, :, 2], other_values)  # only the target block is written
    assert torch.equal(scales[:, :, 2], other_scales)
    assert tiers.counters()[f"kv_{tier}_bytes_loaded"] == 320 + (188 if tier == "disk" else 0)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_values_only_fp8_pool_goes_through_the_tiers(tmp_path, tier):
    # fp8 keeps per-layer scales outside the pool: an entry is the values part alone.
    g = torch.Generator().manual_seed(1)
    values = torch.randn((2, 2, 3, 4, 2, 8), generator=g).to(torch.float8_e4m3fn)
    want = values[:, :, 0].view(torch.uint8).clone()
    kw = dict(host_bytes=256) if tier == "host" else dict(disk_dir=str(tmp_path),
                                                          disk_bytes=10**6)
    tiers = KVTiers(values, _identity(), **kw)
    assert tiers.block_bytes == 2 * 2 * 4 * 2 * 8  # one byte per value, nothing else
    tiers.store(_h(0), 0)
    values[:, :, 1].view(torch.uint8).zero_()
    assert tiers.load(_h(0), 1) == tier
    assert torch.equal(values[:, :, 1].view(torch.uint8), want)


def test_the_disk_checksum_covers_the_scales(tmp_path):
    values, scales = _int8_pool()
    tiers = KVTiers(values, _identity(), disk_dir=str(tmp_path), disk_bytes=10**6,
                    kv_scales=scales)  # fmt: skip
    tiers.store(_h(0), 0)
    path = tiers.disk.path(_h(0))
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x01  # the last scale's high byte: the values are untouched
    path.write_bytes(bytes(raw))
    again = KVTiers(values, _identity(), disk_dir=str(tmp_path), disk_bytes=10**6,
                    kv_scales=scales)  # fmt: skip
    assert again.load(_h(0), 1) is None
    assert again.counters()["kv_disk_corrupt_entries"] == 1 and not path.exists()
