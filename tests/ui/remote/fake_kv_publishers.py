"""Stand-ins for vLLM's and SGLang's KV event publishers (`--kv-events-config`), written from
their sources (vllm/distributed/kv_events.py, sglang/srt/disaggregation/kv_events.py), not from
KVScope's decoder, and a simulated prefix cache to drive them.

`FakeCache` makes valid event streams: prompts sharing a few system prompts stored as chains of
blocks (hash = digest of the parent's hash and the block's tokens: an int of 64 bits or the
32 bytes), a block stored twice (vLLM does not deduplicate), offloads to a lower tier, removals
of held blocks only, AllBlocksCleared. Events are plain tuples ("store", hashes, parent, tokens,
block_size, medium) / ("remove", hashes, medium) / ("clear",).

`recount(events)` is the reference: the blocks a publisher holds after those events, counted
from scratch (a Counter over (hash, medium)); `expected_fleet` merges publishers. Tests compare
KVScope's tree with it.

`FakePublisher` speaks one wire layout over real sockets (a PUB bound to a free loopback port, a
ROUTER answering replays on a thread), and can drop messages, send garbage, restart (sequence
back to 0) and keep a short replay buffer:
- "vllm-map": vLLM since PR #42892 / #45177 (June 2026): events as maps tagged "type" (with
  fields KVScope does not read), replay answers `[topic, seq, payload]`, end `[b"", END, b""]`;
- "vllm-array": vLLM before them: `[tag, fields...]` events, outer `[ts, events, dp_rank]`,
  replay `[seq, payload]`, end `[END, b""]` (after the DEALER's empty delimiter);
- "vllm-v0": vLLM 0.9: `[BlockStored, hashes, parent, tokens, block_size, lora_id]`, no medium,
  outer `[ts, events]`;
- "sglang": SGLang's snapshot-capable publisher: array events with `medium` (GPU, CPU_PINNED,
  DISK) and sometimes a metadata map, outer `[ts, events, attn_dp_rank]`, the topic followed by
  "\\x00sgl-kv-epoch=<epoch>", a new epoch after a restart.
"""

from __future__ import annotations

import collections
import hashlib
import random
import threading
import time
import uuid
from dataclasses import dataclass, field

import msgspec
import zmq

END = (-1).to_bytes(8, "big", signed=True)
LAYOUTS = ("vllm-map", "vllm-array", "vllm-v0", "sglang")
MEDIA = {"vllm-map": ("GPU", "CPU", "STORAGE"), "vllm-array": ("GPU", "CPU"),
         "vllm-v0": (None,), "sglang": ("GPU", "CPU_PINNED", "DISK")}  # fmt: skip


# ------------------------------------------------------------------------ the simulated cache


@dataclass
class FakeCache:
    seed: int = 0
    block_size: int = 4
    hash_kind: str = "int"  # or "bytes"
    media: tuple = ("GPU", "CPU")
    systems: int = 3  # system prompts, the same for every cache with the same prompt_seed
    prompt_seed: int = 0
    held: collections.Counter = field(default_factory=collections.Counter)  # (hash, medium)
    desc: dict = field(default_factory=dict)  # hash -> (parent, tokens)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        shared = random.Random(self.prompt_seed)
        self.prompts = [[shared.randrange(1000) for _ in range(3 * self.block_size)]
                        for _ in range(self.systems)]  # fmt: skip

    def block_hash(self, parent, tokens: tuple[int, ...]):
        raw = repr((parent, tokens)).encode()
        digest = hashlib.sha256(raw).digest()
        return int.from_bytes(digest[:8], "big") if self.hash_kind == "int" else digest

    def chain(self, tokens: list[int]) -> list[tuple]:
        """(hash, parent, tokens) of each full block of a prompt."""
        out, parent, bs = [], None, self.block_size
        for i in range(len(tokens) // bs):
            block = tuple(tokens[i * bs : (i + 1) * bs])
            h = self.block_hash(parent, block)
            out.append((h, parent, block))
            parent = h
        return out

    def prompt(self) -> list[int]:
        base = list(self.rng.choice(self.prompts))
        return base + [self.rng.randrange(1000) for _ in range(self.rng.randrange(1, 4) *
                                                               self.block_size)]

    def step(self) -> list[tuple]:
        """One scheduler step's events."""
        r = self.rng.random()
        if r < 0.5 or not self.held:
            return [self._store(self.prompt(), self.media[0])]
        if r < 0.65:
            return [self._store_again()]
        if r < 0.8 and len(self.media) > 1:
            return [self._offload()]
        if r < 0.995:
            return [self._remove()]
        self.held.clear()
        return [("clear",)]

    def _store(self, tokens: list[int], medium) -> tuple:
        blocks = self.chain(tokens)
        skip = self.rng.randrange(len(blocks))  # the cached prefix is not stored again
        blocks = blocks[skip:]
        return self._emit(blocks, medium)

    def _emit(self, blocks: list[tuple], medium) -> tuple:
        for h, parent, toks in blocks:
            self.held[(h, medium)] += 1
            self.desc.setdefault(h, (parent, toks))
        return ("store", [b[0] for b in blocks], blocks[0][1],
                [t for b in blocks for t in b[2]], self.block_size, medium)

    def _store_again(self) -> tuple:
        """A held block stored once more (vLLM emits it: no deduplication)."""
        h, medium = self.rng.choice(sorted(self.held, key=repr))
        parent, toks = self.desc[h]
        return self._emit([(h, parent, toks)], medium)

    def _offload(self) -> tuple:
        h, _ = self.rng.choice(sorted(self.held, key=repr))
        parent, toks = self.desc[h]
        return self._emit([(h, parent, toks)], self.rng.choice(self.media[1:]))

    def _remove(self) -> tuple:
        keys = sorted(self.held, key=repr)
        picked = self.rng.sample(keys, min(len(keys), self.rng.randrange(1, 4)))
        medium = picked[0][1]
        hashes = [h for h, m in picked if m == medium]
        for h in hashes:
            self.held[(h, medium)] -= 1
            if not self.held[(h, medium)]:
                del self.held[(h, medium)]
        return ("remove", hashes, medium)


def recount(events: list[tuple]) -> dict:
    """hash -> (parent, tokens, frozenset of media) of every block the events leave held."""
    counts: collections.Counter = collections.Counter()
    desc: dict = {}
    for ev in events:
        if ev[0] == "clear":
            counts.clear()
            continue
        medium = (ev[5] if ev[0] == "store" else ev[2]) or "GPU"
        for i, h in enumerate(ev[1]):
            if ev[0] == "store":
                bs = ev[4]
                parent = ev[2] if i == 0 else ev[1][i - 1]
                desc.setdefault(h, (parent, tuple(ev[3][i * bs : (i + 1) * bs])))
                counts[(h, medium)] += 1
            elif counts[(h, medium)] > 0:
                counts[(h, medium)] -= 1
    media: dict = collections.defaultdict(set)
    for (h, m), n in counts.items():
        if n > 0:
            media[h].add(m)
    return {h: (*desc[h], frozenset(ms)) for h, ms in media.items()}


def expected_fleet(held_by: dict[str, dict]) -> dict:
    """source -> recount() merged: hash -> (parent, tokens, media, sources)."""
    out: dict = {}
    for source, nodes in held_by.items():
        for h, (parent, toks, media) in nodes.items():
            p, t, m, s = out.get(h, (parent, toks, frozenset(), frozenset()))
            out[h] = (p, t, m | media, s | {source})
    return out


# ------------------------------------------------------------------------------- encodings


def encode(layout: str, events: list[tuple], ts: float = 0.0, rank: int = 0) -> bytes:
    wire = [_event(layout, ev, i) for i, ev in enumerate(events)]
    if layout == "vllm-v0":
        return msgspec.msgpack.encode([ts, wire])
    return msgspec.msgpack.encode([ts, wire, rank])


def _event(layout: str, ev: tuple, i: int):
    if ev[0] == "clear":
        return {"type": "AllBlocksCleared"} if layout == "vllm-map" else ["AllBlocksCleared"]
    if ev[0] == "remove":
        _, hashes, medium = ev
        if layout == "vllm-map":
            return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium,
                    "group_idx": 0, "locality": "LOCAL"}  # fmt: skip
        return ["BlockRemoved", hashes] + ([] if layout == "vllm-v0" else [medium])
    _, hashes, parent, tokens, bs, medium = ev
    if layout == "vllm-map":
        return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                "token_ids": tokens, "block_size": bs, "lora_id": None, "medium": medium,
                "lora_name": None, "extra_keys": [None] * len(hashes), "group_idx": 0,
                "kv_cache_spec_kind": "full_attention", "session_id": "s1"}  # fmt: skip
    base = ["BlockStored", hashes, parent, tokens, bs, None]
    if layout == "vllm-v0":
        return base
    if layout == "vllm-array":
        return base + [medium, None, [None] * len(hashes), 0]
    return base + [medium] + ([{"cache_salt": "tenant-a"}] if i % 2 else [])


# ------------------------------------------------------------------------------- publisher


class FakePublisher:
    def __init__(self, layout: str = "vllm-map", *, topic: bytes = b"kv@pod-a@m", rank: int = 0,
                 replay: bool = True, buffer_steps: int = 10_000) -> None:  # fmt: skip
        assert layout in LAYOUTS
        self.layout, self.topic, self.rank = layout, topic, rank
        self.buffer_steps = buffer_steps
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.replay_endpoint: str | None = None
        self.lock = threading.Lock()
        self.buffer: collections.deque = collections.deque(maxlen=buffer_steps)
        self.next_seq = 0
        self.epoch = uuid.uuid4().hex
        self.events: list[tuple] = []  # every event since the last restart (the reference)
        self.replays_served = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if replay:
            router = self.ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            port = router.bind_to_random_port("tcp://127.0.0.1")
            self.replay_endpoint = f"tcp://127.0.0.1:{port}"
            self._thread = threading.Thread(target=self._serve, args=(router,), daemon=True)
            self._thread.start()

    @property
    def live_topic(self) -> bytes:
        if self.layout == "sglang":
            return self.topic + b"\x00sgl-kv-epoch=" + self.epoch.encode()
        return self.topic

    def publish(self, events: list[tuple], *, drop: bool = False) -> int:
        """One batch; `drop`: buffered for replay but never sent live (a lost message)."""
        payload = encode(self.layout, events, time.time(), self.rank)
        with self.lock:
            seq = self.next_seq
            self.next_seq += 1
            self.buffer.append((seq, payload))
            self.events.extend(events)
        if not drop:
            self.pub.send_multipart([self.live_topic, seq.to_bytes(8, "big"), payload])
        return seq

    def send_garbage(self, kind: str) -> None:
        """Noise on the live socket: 'frames' (two frames), 'seq' (a 3-byte sequence),
        'payload' (not msgpack, with the next sequence number) or 'shape' (msgpack, not a
        batch, likewise numbered). The numbered ones are in the replay buffer too."""
        if kind in ("frames", "seq"):
            frames = ([self.live_topic, b"oops"] if kind == "frames"
                      else [self.live_topic, b"\x00\x00\x01", b"\x90"])  # fmt: skip
            self.pub.send_multipart(frames)
            return
        payload = b"\xc1\xff not msgpack" if kind == "payload" else msgspec.msgpack.encode(
            {"hello": [1, 2, 3]})
        with self.lock:
            seq = self.next_seq
            self.next_seq += 1
            self.buffer.append((seq, payload))
        self.pub.send_multipart([self.live_topic, seq.to_bytes(8, "big"), payload])

    def restart(self) -> None:
        """A new publisher on the same sockets: numbering from 0, an empty buffer, a new epoch,
        nothing held."""
        with self.lock:
            self.next_seq = 0
            self.buffer.clear()
            self.events = []
            self.epoch = uuid.uuid4().hex

    def expected(self) -> dict:
        with self.lock:
            return recount(list(self.events))

    def _serve(self, router: zmq.Socket) -> None:
        try:
            while not self._stop.is_set():
                if not router.poll(20):
                    continue
                frames = router.recv_multipart()
                if len(frames) != 3:
                    continue
                client, _, start = frames
                self._answer(router, client, int.from_bytes(start, "big"))
        finally:
            router.close(0)

    def _answer(self, router: zmq.Socket, client: bytes, start: int) -> None:
        with self.lock:
            batches = [(s, p) for s, p in self.buffer if s >= start]
            self.replays_served += 1
        with_topic = self.layout == "vllm-map"
        for seq, payload in batches:
            head = [client, b""] + ([self.topic] if with_topic else [])
            router.send_multipart(head + [seq.to_bytes(8, "big"), payload])
        router.send_multipart([client, b""] + ([b""] if with_topic else []) + [END, b""])

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)
        self.pub.close(0)
        self.ctx.term()

    def __enter__(self) -> FakePublisher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
