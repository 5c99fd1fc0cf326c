"""ipc/vllm_events/encode.py against vLLM's own structs: the payload must be byte for byte what
msgspec writes for vllm/distributed/kv_events.py's EventBatch and events, in both encodings
(events as maps after vLLM PR #42892, as arrays before), and the frames vLLM's ZmqEventPublisher
sends."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from ipc.vllm_events import encode as X
from ipc.vllm_events import events as V

# --- vLLM's declarations (vllm/distributed/kv_events.py), the wire contract --------------


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


def _stored_fields() -> dict[str, Any]:
    return {
        "__annotations__": {
            "block_hashes": list[int | bytes],
            "parent_block_hash": int | bytes | None,
            "token_ids": list[int],
            "block_size": int,
            "lora_id": int | None,
            "medium": str | None,
            "lora_name": str | None,
            "extra_keys": list[Any] | None,
            "group_idx": int | None,
            "kv_cache_spec_kind": str | None,
            "kv_cache_spec_sliding_window": int | None,
        },
        "extra_keys": None,
        "group_idx": None,
        "kv_cache_spec_kind": None,
        "kv_cache_spec_sliding_window": None,
    }


def _removed_fields() -> dict[str, Any]:
    return {
        "__annotations__": {"block_hashes": list[int | bytes], "medium": str | None,
                            "group_idx": int | None},  # fmt: skip
        "group_idx": None,
    }


def _vllm_classes(base: type) -> tuple[type, type, type]:
    stored = type("BlockStored", (base,), _stored_fields())
    removed = type("BlockRemoved", (base,), _removed_fields())
    cleared = type("AllBlocksCleared", (base,), {})
    return stored, removed, cleared


def _vllm_payload(batch: V.Batch, base: type, spec: X.GroupSpec) -> bytes:
    stored, removed, cleared = _vllm_classes(base)
    out = []
    for e in batch.events:
        if isinstance(e, V.Stored):
            out.append(stored(list(e.block_hashes), e.parent_block_hash, list(e.token_ids),
                              e.block_size, e.lora_id, e.medium, None, None, e.group_idx,
                              spec.kind, spec.sliding_window))  # fmt: skip
        elif isinstance(e, V.Removed):
            out.append(removed(list(e.block_hashes), e.medium, e.group_idx))
        else:
            out.append(cleared())
    return msgspec.msgpack.encode(EventBatch(batch.ts, out, batch.dp_rank))


BATCH = V.Batch(
    seq=7,
    ts=1757500000.25,
    events=[
        V.Stored((2**64 - 1, 5), None, tuple(range(8)), 4, "GPU"),
        V.Stored((9,), 5, (128000, 65535, 256, 1), 4, "CPU", lora_id=3),
        V.Removed((5, 9), "GPU"),
        V.Cleared(),
        V.Stored((b"\xab" * 32,), b"\x01" * 32, (1, 2, 3, 4), 4, "DISK"),
    ],
    dp_rank=0,
)


@pytest.mark.parametrize("encoding, base", [("map", MapEvent), ("array", ArrayEvent)])
@pytest.mark.parametrize(
    "spec", [X.GroupSpec(), X.GroupSpec(X.SLIDING_WINDOW, 4096)], ids=["full", "sliding"]
)
def test_payload_is_what_vllm_structs_encode(encoding, base, spec):
    assert X.encode_batch(BATCH, encoding, {0: spec}) == _vllm_payload(BATCH, base, spec)


def test_map_events_leave_out_defaulted_fields_but_keep_vllms_required_ones():
    batch = msgspec.msgpack.decode(X.encode_batch(BATCH))
    assert batch[0] == BATCH.ts and batch[2] == 0
    first = batch[1][0]
    assert list(first) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                           "lora_id", "medium", "lora_name", "group_idx",
                           "kv_cache_spec_kind"]  # fmt: skip
    assert first["lora_id"] is None and first["lora_name"] is None
    assert batch[1][3] == {"type": "AllBlocksCleared"}


def test_array_events_are_tag_then_every_field():
    batch = msgspec.msgpack.decode(X.encode_batch(BATCH, "array"))
    assert batch[1][0] == ["BlockStored", [2**64 - 1, 5], None, list(range(8)), 4, None, "GPU",
                           None, None, 0, "full_attention", None]  # fmt: skip
    assert batch[1][2] == ["BlockRemoved", [5, 9], "GPU", 0]
    assert batch[1][3] == ["AllBlocksCleared"]


def test_hash_folding_keeps_the_low_64_bits_big_endian():
    digest = bytes(range(32))
    assert X.fold_hash(digest) == int.from_bytes(digest[-8:], "big")
    assert X.fold_hash(digest) == int.from_bytes(digest, "big") & (2**64 - 1)
    assert X.wire_hash(digest, "bytes") == digest


def test_frames_are_vllms():
    assert X.pub_frames(b"kv", 1, b"P") == [b"kv", b"\x00" * 7 + b"\x01", b"P"]
    assert X.replay_frames(b"id", b"kv", 2, b"P") == [b"id", b"", b"kv", (2).to_bytes(8, "big"),
                                                      b"P"]  # fmt: skip
    assert X.replay_end_frames(b"id") == [b"id", b"", b"", b"\xff" * 8, b""]
    assert X.END_SEQ == (-1).to_bytes(8, "big", signed=True)
