"""The engine server's outbound broadcasts: heartbeats, telemetry snapshots and KV cache events
on the PUB socket (docs/PROTOCOL.md sections 4 and 6), and the same KV cache events in vLLM's
format when `--kv-events-config` asks for them (engine_proc/server/vllm_publisher.py). A mixin of
EngineServer (engine_proc/server/engine_server.py), which owns the state it reads."""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec
import zmq

from engine_proc.server.vllm_publisher import VllmEventPublisher
from engine_proc.server.wire import kv_event_batch, telemetry_from_snapshot
from ipc import protocol as P
from ipc.vllm_events.encode import SLIDING_WINDOW, GroupSpec

log = logging.getLogger("engine_proc.server")


class Publishing:
    """Needs the server's _send and _reap_dead (EngineServer provides them)."""

    pub: Any
    engine: Any
    cfg: Any
    ctx: Any
    vllm_events: VllmEventPublisher | None
    paused: bool
    _clients: dict
    _inflight: dict
    _telemetry_seq: int
    _kv_events_seq: int
    _last_telemetry: float
    _telemetry_dirty: bool
    _model_info: P.ModelInfo | None

    def _heartbeat(self, now: float) -> None:
        assert self.pub is not None
        hb = P.Heartbeat(time=now, paused=self.paused)
        self._publish(P.TOPIC_HEARTBEAT, hb)
        for client in list(self._clients.values()):
            if client.requests:
                self._send(client.routing_id, hb)
        self._reap_dead()

    def _publish(self, topic: bytes, msg: msgspec.Struct) -> None:
        assert self.pub is not None
        try:
            self.pub.send_multipart([topic, P.encode(msg)], zmq.NOBLOCK)
        except zmq.Again:
            pass  # a slow subscriber loses snapshots; the engine never waits for it

    def _start_vllm_events(self) -> None:
        """The vLLM-format publisher, when --kv-events-config enables one (after the model
        info is known: its block size and KV groups go into every BlockStored)."""
        cfg = self.cfg.vllm_events
        if cfg is None or not cfg.active:
            return
        assert self._model_info is not None
        groups = self._model_info.kv_groups
        window = groups[0].window if groups else None  # group 0 is the one with events
        spec = GroupSpec(SLIDING_WINDOW, window) if window else GroupSpec()
        self.vllm_events = VllmEventPublisher(cfg, self.ctx, self._model_info.block_size,
                                              {0: spec})  # fmt: skip
        self.vllm_events.bind()

    def _publish_kv_events(self) -> None:
        """What the prefix cache stored and removed since the last tick: one drain, published
        as one batch on the kv_events topic and one in vLLM's format."""
        drain = getattr(self.engine, "drain_kv_events", None)
        if drain is None:
            return
        try:
            events, overflowed = drain()
        except Exception:
            log.exception("draining KV cache events failed")
            return
        if overflowed:
            log.warning("KV cache events overflowed before a tick; published a replay instead")
        if self.vllm_events is not None:
            try:
                self.vllm_events.publish(events)
            except Exception:  # a publishing bug must not stop the native stream or the engine
                log.exception("publishing vLLM-format KV events failed")
        if events and self.cfg.kv_events:
            self._kv_events_seq += 1
            assert self._model_info is not None
            batch = kv_event_batch(
                events, self._kv_events_seq, time.monotonic(), self._model_info.block_size
            )
            self._publish(P.TOPIC_KV_EVENTS, batch)

    def _publish_telemetry(self) -> None:
        self._publish_kv_events()  # first: a view joins them with this snapshot's blocks
        self._last_telemetry = time.monotonic()
        self._telemetry_dirty = False
        try:
            snap = self.engine.snapshot()
            self._telemetry_seq += 1
            msg = telemetry_from_snapshot(
                snap, self._telemetry_seq, self.paused, len(self._clients), self._origins()
            )
        except Exception:
            log.exception("engine.snapshot() failed; no telemetry this time")
            return
        msg.kv_events_seq = self._kv_events_seq
        msg.counters.update(self._extra_counters())
        self._publish(P.TOPIC_TELEMETRY, msg)

    def _origins(self) -> dict[str, str]:
        """Request id -> the name its client gave in hello (empty when it sent none)."""
        names = {cid: c.name for cid, c in self._clients.items() if c.name}
        return {rid: names[fl.client] for rid, fl in self._inflight.items() if fl.client in names}

    def _extra_counters(self) -> dict[str, float]:
        return {}
