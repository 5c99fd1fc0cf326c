"""KV cache events in vLLM's wire format, from the engine server (`--kv-events-config`), so that
KV-aware routers written for vLLM (llm-d, Dynamo, AIBrix, ...) index this engine's prefix cache.

What vLLM's ZmqEventPublisher does (vllm/distributed/kv_events.py), in the server's own thread
instead of a publisher thread: a PUB socket sends `[topic, seq, payload]` per batch, seq from 0
and +1 per batch; the last `buffer_steps` batches are kept, and a ROUTER on `replay_endpoint`
answers a DEALER's `[b"", start_seq]` with every kept batch from start_seq on, then an end
marker (frames in ipc/vllm_events/encode.py). One batch per drain of the engine's KV event log
that changed something; the native `kv_events` topic is fed from the same drain.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import zmq

from engine_proc.server.vllm_convert import Converter
from ipc import endpoints as E
from ipc.vllm_events import encode
from ipc.vllm_events.config import KVEventsConfig, offset_endpoint_port, pub_binds
from ipc.vllm_events.events import Batch

log = logging.getLogger("engine_proc.server.vllm_events")

MAX_REPLAY_REQUESTS = 16  # answered per loop turn, so a flood cannot stall the engine
REPLAY_REQUEST_BYTES = 1024  # a request is three short frames; bigger ones drop the peer


class VllmEventPublisher:
    def __init__(
        self,
        cfg: KVEventsConfig,
        ctx: zmq.Context,
        block_size: int,
        specs: dict[int, encode.GroupSpec],
        dp_rank: int = 0,
    ) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.specs = specs
        self.dp_rank = dp_rank
        self.converter = Converter(block_size, cfg.hash_type)
        self.topic = cfg.topic.encode("utf-8")
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._seq = itertools.count()
        self.pub: zmq.Socket | None = None
        self.replay: zmq.Socket | None = None
        self.endpoint = ""  # where the PUB bound or connected (the real port of a '*' bind)
        self.replay_endpoint = ""

    def bind(self) -> None:
        endpoint = offset_endpoint_port(self.cfg.endpoint, self.dp_rank)
        assert endpoint is not None
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.set_hwm(self.cfg.hwm)  # both directions, as vLLM's set_hwm
        self.pub.setsockopt(zmq.MAXMSGSIZE, 64 * 1024)  # inbound = subscriptions only
        self.pub.setsockopt(zmq.LINGER, 200)
        if pub_binds(endpoint):
            self.endpoint = self._bind(self.pub, endpoint)
        else:  # vLLM's rule: a host:port is a peer (e.g. a proxy's XSUB) to connect to
            self.pub.connect(endpoint)
            self.endpoint = endpoint
        replay = offset_endpoint_port(self.cfg.replay_endpoint, self.dp_rank)
        if replay is not None:
            self.replay = self.ctx.socket(zmq.ROUTER)
            self.replay.setsockopt(zmq.MAXMSGSIZE, REPLAY_REQUEST_BYTES)
            # a whole buffer fits in the peer's queue: without it a ROUTER drops what is over
            self.replay.setsockopt(zmq.SNDHWM, self.cfg.buffer_steps + 1)
            self.replay.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = self._bind(self.replay, replay)
        log.info("vLLM-format KV events on %s (replay %s), topic %r, %s encoding, %s hashes",
                 self.endpoint, self.replay_endpoint or "off", self.cfg.topic,
                 self.cfg.encoding, self.cfg.hash_type)  # fmt: skip

    @staticmethod
    def _bind(sock: zmq.Socket, endpoint: str) -> str:
        sock.bind(endpoint)
        bound = sock.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint
        if not E.is_loopback(endpoint):
            # vLLM's default (tcp://*:5557) listens on every interface, with no access control:
            # honoured, as the user asked for it, but said out loud.
            log.warning("KV events: %s is open to other machines or users, and asks no token; "
                        "keep it behind a firewall, or use tcp://127.0.0.1:* (a free loopback "
                        "port, named in the ready line) or ipc://PATH", bound)  # fmt: skip
        return E.connect_address(bound)

    def publish(self, native: Sequence[Any]) -> None:
        """Convert one drain of the engine's event log; publish it when something changed."""
        events = self.converter.convert(native)
        if not events or self.pub is None:
            return
        seq = next(self._seq)
        batch = Batch(seq=seq, ts=time.time(), events=events, dp_rank=self.dp_rank)
        payload = encode.encode_batch(batch, self.cfg.encoding, self.specs)
        self.buffer.append((seq, payload))
        try:
            self.pub.send_multipart(encode.pub_frames(self.topic, seq, payload), zmq.NOBLOCK)
        except zmq.Again:
            pass  # a subscriber past the high-water mark loses it (and can ask for a replay)

    def service_replay(self) -> None:
        """Answer the replay requests waiting on the ROUTER (vLLM's _service_replay)."""
        assert self.replay is not None
        for _ in range(MAX_REPLAY_REQUESTS):
            try:
                frames = self.replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3:
                log.warning("KV events: invalid replay request of %d frames", len(frames))
                continue
            identity, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in self.buffer:
                if seq >= start_seq:
                    self._send(encode.replay_frames(identity, self.topic, seq, payload))
            self._send(encode.replay_end_frames(identity))

    def _send(self, frames: list[bytes]) -> None:
        assert self.replay is not None
        try:
            self.replay.send_multipart(frames, zmq.NOBLOCK)
        except zmq.ZMQError:  # the peer is gone or stuck: a ROUTER drops, the engine goes on
            pass

    def close(self) -> None:
        for sock in (self.pub, self.replay):
            if sock is not None and not sock.closed:
                sock.close()
