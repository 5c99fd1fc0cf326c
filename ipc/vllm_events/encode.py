"""Batches of `events.Stored / Removed / Cleared` -> the MessagePack payload and ZeroMQ frames
vLLM's ZmqEventPublisher sends (vllm/distributed/kv_events.py), so that any subscriber written
for vLLM reads KVScope's engine.

The batch is vLLM's `EventBatch` (msgspec array_like): `[ts, events, data_parallel_rank]`. Each
event is a `KVCacheEvent` (msgspec tag=True, omit_defaults=True), in one of two encodings:
- "map" (vLLM after PR #42892: releases after 0.23): `{"type": "BlockStored",
  "block_hashes": ..., ...}`, keys in vLLM's declaration order; a field holding its default
  (None) is left out unless it has no default (lora_id, medium, lora_name are always there);
- "array" (vLLM <= 0.23, array_like=True): `["BlockStored", block_hashes, ...]`, every field
  in declaration order (msgspec writes defaults in arrays too; older decoders ignore trailing
  fields they do not know).
Field order, both encodings: BlockStored block_hashes, parent_block_hash, token_ids, block_size,
lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind,
kv_cache_spec_sliding_window; BlockRemoved block_hashes, medium, group_idx; AllBlocksCleared
nothing.

Frames: PUB `[topic, seq, payload]`; replay (ROUTER, to a DEALER) `[identity, b"", topic, seq,
payload]` per batch, then `[identity, b"", b"", END_SEQ, b""]` (vLLM after PR #45177, which
added the topic frame). seq is 8 bytes big-endian, END_SEQ is -1 in 8 signed bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from ipc.vllm_events.events import Batch, BlockHash, Cleared, Event, Removed, Stored

MASK64 = (1 << 64) - 1
END_SEQ = (-1).to_bytes(8, "big", signed=True)
FULL_ATTENTION, SLIDING_WINDOW = "full_attention", "sliding_window"  # vLLM KVCacheSpecKind


@dataclass(slots=True, frozen=True)
class GroupSpec:
    """What a BlockStored says of its group's KV cache spec."""

    kind: str = FULL_ATTENTION
    sliding_window: int | None = None


def fold_hash(digest: bytes) -> int:
    """vLLM's maybe_convert_block_hash with int hashes (the default): the digest read as one
    big-endian integer, low 64 bits kept (its last 8 bytes)."""
    return int.from_bytes(digest, "big") & MASK64


def wire_hash(digest: bytes, hash_type: str) -> BlockHash:
    return fold_hash(digest) if hash_type == "int" else bytes(digest)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def pub_frames(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    return [topic, seq_bytes(seq), payload]


def replay_frames(identity: bytes, topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    return [identity, b"", topic, seq_bytes(seq), payload]


def replay_end_frames(identity: bytes) -> list[bytes]:
    return [identity, b"", b"", END_SEQ, b""]


def encode_batch(
    batch: Batch, encoding: str = "map", specs: Mapping[int, GroupSpec] | None = None
) -> bytes:
    """The payload frame of one batch; `specs` names each group's cache spec (full attention
    when a group is missing)."""
    specs = specs or {}
    as_array = encoding == "array"
    events = [_event(e, as_array, specs) for e in batch.events]
    return msgspec.msgpack.encode([batch.ts, events, batch.dp_rank])


def _event(e: Event, as_array: bool, specs: Mapping[int, GroupSpec]) -> Any:
    if isinstance(e, Stored):
        spec = specs.get(e.group_idx, GroupSpec())
        items = [
            ("block_hashes", list(e.block_hashes)),
            ("parent_block_hash", e.parent_block_hash),
            ("token_ids", list(e.token_ids)),
            ("block_size", e.block_size),
            ("lora_id", e.lora_id),
            ("medium", e.medium),
            ("lora_name", None),  # KVScope serves no LoRA adapters
            ("extra_keys", None),  # KVScope's hashes take no extra keys (salt is in the root)
            ("group_idx", e.group_idx),
            ("kv_cache_spec_kind", spec.kind),
            ("kv_cache_spec_sliding_window", spec.sliding_window),
        ]
        return _tagged("BlockStored", items, as_array, required=7)
    if isinstance(e, Removed):
        items = [("block_hashes", list(e.block_hashes)), ("medium", e.medium),
                 ("group_idx", e.group_idx)]  # fmt: skip
        return _tagged("BlockRemoved", items, as_array, required=2)
    assert isinstance(e, Cleared)
    return _tagged("AllBlocksCleared", [], as_array, required=0)


def _tagged(tag: str, items: list[tuple[str, Any]], as_array: bool, required: int) -> Any:
    """`required`: how many leading fields vLLM declares without a default (written even as
    None); the map encoding leaves out later ones that hold their default, None."""
    if as_array:
        return [tag, *(v for _, v in items)]
    out: dict[str, Any] = {"type": tag}
    for i, (k, v) in enumerate(items):
        if i < required or v is not None:
            out[k] = v
    return out

