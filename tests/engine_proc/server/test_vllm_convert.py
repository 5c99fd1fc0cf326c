"""engine_proc/server/vllm_convert.py: the engine's native KV events -> vLLM's: media, folded
hashes, chains merged, and vLLM's medium-less AllBlocksCleared only when nothing is left."""

from __future__ import annotations

import hashlib

from engine_proc.core.kv_events import (
    DISK,
    HOST,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    full_replay,
)
from engine_proc.server.vllm_convert import Converter
from ipc.vllm_events import events as V

BS = 2


def h(i: int) -> bytes:
    return hashlib.sha256(bytes([i])).digest()


def low64(d: bytes) -> int:
    return int.from_bytes(d[-8:], "big")


def chain(n: int, medium: str = "pool", start: int = 0) -> list[BlockStored]:
    return [BlockStored(h(i), h(i - 1) if i else None, [i, i], i, medium)
            for i in range(start, start + n)]  # fmt: skip


def test_a_prefill_is_one_stored_chain_with_gpu_medium_and_folded_hashes():
    out = Converter(BS).convert(chain(3))
    assert out == [V.Stored(tuple(low64(h(i)) for i in range(3)), None, (0, 0, 1, 1, 2, 2), BS,
                            "GPU")]  # fmt: skip


def test_bytes_hashes_keep_the_digest():
    out = Converter(BS, hash_type="bytes").convert(chain(2, start=1))
    assert out[0].block_hashes == (h(1), h(2)) and out[0].parent_block_hash == h(0)


def test_tiers_are_cpu_and_disk_and_removals_merge_per_medium():
    c = Converter(BS)
    c.convert(chain(3))
    out = c.convert([BlockStored(h(0), None, [0, 0], -1, HOST), BlockRemoved(h(2)),
                     BlockRemoved(h(1)), BlockStored(h(0), None, [0, 0], -1, DISK)])  # fmt: skip
    assert [type(e).__name__ for e in out] == ["Stored", "Removed", "Stored"]
    assert out[0].medium == "CPU" and out[2].medium == "DISK"
    assert out[1] == V.Removed((low64(h(2)), low64(h(1))), "GPU")


def test_clearing_one_tier_removes_its_blocks_only():
    c = Converter(BS)
    c.convert(chain(2) + [BlockStored(h(5), None, [5, 5], -1, HOST)])
    out = c.convert([AllBlocksCleared(HOST)])
    assert out == [V.Removed((low64(h(5)),), "CPU")]


def test_removals_that_empty_everything_are_one_all_blocks_cleared():
    c = Converter(BS)
    c.convert(chain(2) + [BlockStored(h(5), None, [5, 5], -1, HOST)])
    out = c.convert([BlockRemoved(h(0)), BlockRemoved(h(1)), AllBlocksCleared(HOST),
                     AllBlocksCleared(DISK)])  # fmt: skip
    assert out == [V.Cleared()]
    assert c.convert([BlockRemoved(h(9))]) == [V.Cleared()]  # still nothing: says so again


def test_a_native_replay_is_a_clear_then_every_block():
    c = Converter(BS)
    c.convert(chain(2))
    out = c.convert(full_replay(chain(2)))
    assert out == [V.Cleared(), V.Stored((low64(h(0)), low64(h(1))), None, (0, 0, 1, 1), BS,
                                         "GPU")]  # fmt: skip
