"""A subscriber to vLLM's KV cache events written from vLLM's source layout alone
(vllm/distributed/kv_events.py and its PRs #42892, map events, and #45177, the replay's topic
frame), with raw ZeroMQ and the `msgpack` package: it imports nothing from KVScope, so a test
that passes with it shows that a consumer written for vLLM reads KVScope's engine.

    PUB frames       [topic, seq (8 bytes big-endian), payload]
    replay request   DEALER sends [b"", start_seq (8 bytes big-endian)] to the ROUTER
    replay reply     [b"", topic, seq, payload] per kept batch with seq >= start_seq,
                     then [b"", b"", -1 (8 signed bytes), b""]
    payload          [ts, events, data_parallel_rank]; an event is a map {"type": ..., fields}
                     (vLLM after 0.23) or an array [type, fields...] (vLLM <= 0.23)

tests/test_architecture.py-style check: test_vllm_kv_events.py asserts this module's imports.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)
# vLLM's declaration order: what an array event's positions mean
FIELDS = {
    "BlockStored": ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                    "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
                    "kv_cache_spec_sliding_window"],  # fmt: skip
    "BlockRemoved": ["block_hashes", "medium", "group_idx"],
    "AllBlocksCleared": [],
}


def decode_payload(payload: bytes) -> tuple[float, list[dict[str, Any]], int | None]:
    """(ts, events as {"type": ..., field: value}, data_parallel_rank)."""
    batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    ts, raw_events = batch[0], batch[1]
    rank = batch[2] if len(batch) > 2 else None
    return ts, [normalize(e) for e in raw_events], rank


def normalize(event: Any) -> dict[str, Any]:
    if isinstance(event, dict):
        return dict(event)
    tag, values = event[0], event[1:]
    return {"type": tag, **dict(zip(FIELDS[tag], values, strict=False))}


@dataclass
class Node:
    parent: Any
    tokens: list[int]
    media: set[Any] = field(default_factory=set)


class Tree:
    """The cached blocks as vLLM consumers index them: hash -> parent, tokens, media."""

    def __init__(self) -> None:
        self.nodes: dict[Any, Node] = {}

    def apply(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        if kind == "AllBlocksCleared":
            self.nodes.clear()
        elif kind == "BlockStored":
            parent, size = event["parent_block_hash"], event["block_size"]
            for i, h in enumerate(event["block_hashes"]):
                tokens = event["token_ids"][i * size : (i + 1) * size]
                node = self.nodes.setdefault(h, Node(parent, tokens))
                node.media.add(event.get("medium"))
                parent = h
        elif kind == "BlockRemoved":
            for h in event["block_hashes"]:
                node = self.nodes.get(h)
                if node is not None:
                    node.media.discard(event.get("medium"))
                    if not node.media:
                        del self.nodes[h]


class Subscriber:
    """Receives every published batch on a thread; replay() asks the ROUTER for old ones."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, topic: bytes = b"") -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.setsockopt(zmq.RCVHWM, 0)
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.received: list[tuple[bytes, int, bytes]] = []  # (topic, seq, payload)
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.sub.poll(50):
                topic, seq, payload = self.sub.recv_multipart()
                with self.lock:
                    self.received.append((topic, int.from_bytes(seq, "big"), payload))

    def live(self) -> list[tuple[bytes, int, bytes]]:
        with self.lock:
            return list(self.received)

    def replay(self, start_seq: int, timeout_ms: int = 10_000) -> list[tuple[bytes, int, bytes]]:
        assert self.replay_endpoint is not None
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
            out = []
            while True:
                if not dealer.poll(timeout_ms):
                    raise TimeoutError("no end marker from the replay endpoint")
                empty, topic, seq, payload = dealer.recv_multipart()
                assert empty == b""
                if seq == END_SEQ:
                    assert topic == b"" and payload == b""
                    return out
                out.append((topic, int.from_bytes(seq, "big"), payload))
        finally:
            dealer.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sub.close(0)
        self.ctx.term()
