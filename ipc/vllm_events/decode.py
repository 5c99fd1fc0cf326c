"""Decoding what a vLLM-format KV event publisher sends (vLLM's and SGLang's `ZmqEventPublisher`,
KVScope's), into events.Batch; no Qt, no torch, no sockets.

The payload is msgpack. The batch is a positional array `[ts, events, dp_rank]` (vLLM's
`data_parallel_rank`, SGLang's `attn_dp_rank`; older publishers send only `[ts, events]`) or a
map with those names. Each event is either
- an array `[tag, field, ...]` (msgspec `array_like=True`, tag = the class name): vLLM up to
  PR #42892 (June 2026), SGLang; trailing fields may be missing (older versions) or added
  (newer ones): vLLM `[BlockStored, block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium, lora_name, extra_keys, group_idx, ...]`, SGLang `[..., lora_id, medium,
  metadata]`; `[BlockRemoved, block_hashes, medium, group_idx]`; `[AllBlocksCleared]`;
- or a map tagged by "type" (vLLM since #42892, newer SGLang): fields by name, unknown names
  ignored, missing optional ones defaulted.
Hashes are ints (vLLM's default: 64 bits of the digest; SGLang's) or bytes (a full digest).

Frames (vLLM's and SGLang's publishers alike): live `[topic, seq, payload]` with `seq` 8 bytes
big-endian, the topic matched by prefix (SGLang's snapshot-capable publisher appends
"\\x00sgl-kv-epoch=<epoch>"). A replay request is `[b"", start_seq]` from a DEALER; the answer is
one message per buffered batch and then an end marker whose sequence is 0xFF * 8 and payload
empty. A DEALER sees `[b"", seq, payload]` / `[b"", END, b""]` from SGLang and vLLM before PR
#45177 (June 2026), `[b"", topic, seq, payload]` / `[b"", b"", END, b""]` from vLLM after it;
a REQ socket sees the same without the leading b"". `parse_replay` takes them all: the last two
frames are the sequence and the payload.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from ipc.vllm_events.events import Batch, BlockHash, Cleared, Event, Removed, Stored

END_SEQ = b"\xff" * 8  # (-1).to_bytes(8, "big", signed=True): the end of a replay
EPOCH_MARKER = b"\x00sgl-kv-epoch="  # SGLang: a publisher's lifetime, appended to the topic

# Positional fields after the tag; "_" marks a field whose meaning differs between publishers
# (vLLM's lora_name where SGLang puts its metadata map; vLLM's extra_keys): ignored.
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                  "medium", "_", "_", "group_idx")  # fmt: skip
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
_FIELDS = {"BlockStored": _STORED_FIELDS, "BlockRemoved": _REMOVED_FIELDS,
           "AllBlocksCleared": ()}  # fmt: skip


class DecodeError(ValueError):
    """A frame or payload that is not a vLLM-format KV event batch; says what was wrong."""


@dataclass(slots=True, frozen=True)
class Frame:
    topic: bytes
    seq: int
    payload: bytes


def decode_payload(payload: bytes, seq: int = 0) -> Batch:
    try:
        raw = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, ValueError) as exc:
        raise DecodeError(f"payload is not msgpack: {exc}") from None
    ts, events, rank = _batch_fields(raw)
    return Batch(seq=seq, ts=ts, events=[_event(e, i) for i, e in enumerate(events)],
                 dp_rank=rank)


def _batch_fields(raw: Any) -> tuple[float, list, int | None]:
    if isinstance(raw, list) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    elif isinstance(raw, dict):
        ts, events = raw.get("ts"), raw.get("events")
        rank = raw.get("data_parallel_rank", raw.get("attn_dp_rank"))
    else:
        raise DecodeError(f"a batch is [ts, events, dp_rank] or a map; got {_kind(raw)}")
    if not _is_number(ts):
        raise DecodeError(f"batch ts is {_kind(ts)}, not a number")
    if not isinstance(events, list):
        raise DecodeError(f"batch events is {_kind(events)}, not a list")
    if rank is not None and not _is_int(rank):
        raise DecodeError(f"batch dp rank is {_kind(rank)}, not an int")
    return float(ts), events, rank


def _event(raw: Any, i: int) -> Event:
    tag, fields = _tag_and_fields(raw, i)
    where = f"event {i} ({tag})"
    if tag == "AllBlocksCleared":
        return Cleared()
    hashes = _hashes(fields.get("block_hashes"), where)
    medium = _opt_str(fields.get("medium"), where, "medium")
    group = _opt_int(fields.get("group_idx"), where, "group_idx") or 0
    if tag == "BlockRemoved":
        return Removed(block_hashes=hashes, medium=medium, group_idx=group)
    parent = fields.get("parent_block_hash")
    if parent is not None and not _is_hash(parent):
        raise DecodeError(f"{where}: parent_block_hash is {_kind(parent)}, not a hash")
    block_size = fields.get("block_size")
    if not _is_int(block_size) or block_size <= 0:
        raise DecodeError(f"{where}: block_size is {block_size!r}, not a positive int")
    return Stored(block_hashes=hashes, parent_block_hash=parent,
                  token_ids=_tokens(fields.get("token_ids"), where), block_size=block_size,
                  medium=medium, group_idx=group,
                  lora_id=_opt_int(fields.get("lora_id"), where, "lora_id"))  # fmt: skip


def _tag_and_fields(raw: Any, i: int) -> tuple[str, dict]:
    if isinstance(raw, dict):
        tag, fields = raw.get("type"), raw
    elif isinstance(raw, list) and raw:
        tag, fields = raw[0], None
    else:
        raise DecodeError(f"event {i} is {_kind(raw)}, not a tagged array or map")
    if tag not in _FIELDS:
        raise DecodeError(f"event {i} has unknown type {tag!r}")
    if fields is None:  # positional: name what we read, ignore what follows
        fields = dict(zip(_FIELDS[tag], raw[1:], strict=False))
    if tag != "AllBlocksCleared" and "block_hashes" not in fields:
        raise DecodeError(f"event {i} ({tag}) has no block_hashes")
    return tag, fields


def _hashes(raw: Any, where: str) -> tuple[BlockHash, ...]:
    if not isinstance(raw, list):
        raise DecodeError(f"{where}: block_hashes is {_kind(raw)}, not a list")
    for j, h in enumerate(raw):
        if not _is_hash(h):
            raise DecodeError(f"{where}: block_hashes[{j}] is {_kind(h)}, not an int or bytes")
    return tuple(raw)


def _tokens(raw: Any, where: str) -> tuple[int, ...]:
    if not isinstance(raw, list):
        raise DecodeError(f"{where}: token_ids is {_kind(raw)}, not a list")
    if not all(type(t) is int for t in raw):  # bool is an int subclass: not a token
        bad = next(t for t in raw if type(t) is not int)
        raise DecodeError(f"{where}: token_ids holds {_kind(bad)}, not only ints")
    return tuple(raw)


def _opt_int(raw: Any, where: str, name: str) -> int | None:
    if raw is not None and not _is_int(raw):
        raise DecodeError(f"{where}: {name} is {_kind(raw)}, not an int")
    return raw


def _opt_str(raw: Any, where: str, name: str) -> str | None:
    if raw is not None and not isinstance(raw, str):
        raise DecodeError(f"{where}: {name} is {_kind(raw)}, not a string")
    return raw


def _is_int(x: Any) -> bool:
    return type(x) is int


def _is_number(x: Any) -> bool:
    return type(x) in (int, float)


def _is_hash(x: Any) -> bool:
    return type(x) is int or (type(x) is bytes and len(x) > 0)


def _kind(x: Any) -> str:
    return "nothing" if x is None else type(x).__name__


# ------------------------------------------------------------------------------------ frames


def parse_live(frames: list[bytes], topic: bytes = b"") -> Frame:
    """A PUB message `[topic, seq, payload]` whose topic starts with `topic`."""
    if len(frames) != 3:
        raise DecodeError(f"a live message has 3 frames [topic, seq, payload]; got {len(frames)}")
    if not frames[0].startswith(topic):
        raise DecodeError(f"topic {frames[0][:40]!r} does not start with {topic!r}")
    return Frame(frames[0], _seq(frames[1]), frames[2])


def parse_replay(frames: list[bytes]) -> Frame | None:
    """One answer to a replay request, in any of the layouts above; None for the end marker."""
    if not 2 <= len(frames) <= 4:
        raise DecodeError(f"a replay message has 2 to 4 frames; got {len(frames)}")
    head, (seq, payload) = frames[:-2], frames[-2:]
    if len(head) == 2 and head[0] != b"":
        raise DecodeError("a 4-frame replay message starts with an empty delimiter")
    if seq == END_SEQ:
        if payload:
            raise DecodeError("the replay end marker carries a payload")
        return None
    return Frame(head[-1] if head else b"", _seq(seq), payload)


def replay_request(start_seq: int) -> list[bytes]:
    """What a DEALER sends to the publisher's ROUTER: replay every batch from `start_seq` on."""
    return [b"", start_seq.to_bytes(8, "big")]


def topic_epoch(topic: bytes) -> bytes | None:
    """SGLang's publisher lifetime token in a topic, None when the topic carries none."""
    at = topic.find(EPOCH_MARKER)
    if at < 0:
        return None
    rest = topic[at + len(EPOCH_MARKER):]
    return rest.split(b"\x00", 1)[0]


def _seq(raw: bytes) -> int:
    if len(raw) != 8:
        raise DecodeError(f"a sequence number is 8 bytes big-endian; got {len(raw)} bytes")
    return int.from_bytes(raw, "big")
