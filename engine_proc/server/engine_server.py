"""The engine process's socket loop: ROUTER for clients, PUB for telemetry (docs/PROTOCOL.md).

One thread does everything: drain the ROUTER without blocking, step the engine, send each
request's delta right after the step, publish telemetry at its own rate, heartbeat. With no work
it blocks in poll until a message, a timer or a signal arrives (idle ~ 0% CPU).

CLI: `python -m engine_proc serve ...` (engine_proc/server/cli.py); messages are built from
engine objects in engine_proc/server/wire.py.
"""

from __future__ import annotations

import hmac
import logging
import shutil
import socket
import time
from typing import Any

import msgspec
import zmq

from engine_proc.engine.chat_render import ChatPrompt, message_dicts
from engine_proc.server.config import ServerConfig
from engine_proc.server.control import Controls
from engine_proc.server.disagg import Disaggregation, PendingPull
from engine_proc.server.publish import Publishing
from engine_proc.server.requests import Client, InFlight, RequestTracking
from engine_proc.server.vllm_publisher import VllmEventPublisher
from engine_proc.server.wire import ids_of_undecodable, live_config_of
from ipc import endpoints as E
from ipc import protocol as P

log = logging.getLogger(__name__)

MAX_MESSAGES_PER_TURN = 256  # ROUTER messages handled between two engine steps
ROUTER_SNDHWM = 100_000  # replies queued per client before it counts as stuck
PUB_SNDHWM = 16  # snapshots queued per subscriber; a slow subscriber loses the older ones


class EngineServer(RequestTracking, Controls, Publishing):
    """Serves one engine object (the API in docs/DEVELOPING.md) over ZeroMQ."""

    def __init__(
        self, engine: Any, config: ServerConfig, context: zmq.Context | None = None
    ) -> None:
        self.engine = engine
        self.cfg = config
        self.ctx = context or zmq.Context()
        self._own_ctx = context is None
        self.paused = False
        self.endpoint = ""
        self.pub_endpoint = ""
        self._runtime_dir: str | None = None
        self._clients: dict[bytes, Client] = {}
        self._inflight: dict[str, InFlight] = {}
        self._stop_reason: str | None = None
        self._dead: set[bytes] = set()  # clients whose sends failed during this turn
        self._telemetry_seq = 0
        self._kv_events_seq = 0
        self._last_telemetry = 0.0
        self._telemetry_dirty = True
        self._last_heartbeat = 0.0
        self._model_info: P.ModelInfo | None = None
        self.router: zmq.Socket | None = None
        self.pub: zmq.Socket | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.disagg: Disaggregation | None = None
        self.vllm_events: VllmEventPublisher | None = None  # --kv-events-config

    # ---------------------------------------------------------------- setup

    def bind(self) -> tuple[str, str]:
        endpoint, self._runtime_dir = E.resolve_auto(self.cfg.endpoint, None, "engine.sock")
        pub_endpoint, self._runtime_dir = E.resolve_auto(
            self.cfg.pub_endpoint, self._runtime_dir, "telemetry.sock"
        )
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.MAXMSGSIZE, P.MAX_CLIENT_MESSAGE_BYTES)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unroutable send -> error, not silence
        self.router.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting client keeps its id
        self.router.setsockopt(zmq.SNDHWM, ROUTER_SNDHWM)
        self.router.setsockopt(zmq.RCVHWM, 10_000)
        self.router.setsockopt(zmq.LINGER, 1000)
        self.router.bind(endpoint)
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.MAXMSGSIZE, 64 * 1024)  # inbound = subscriptions only
        self.pub.setsockopt(zmq.SNDHWM, PUB_SNDHWM)
        self.pub.setsockopt(zmq.LINGER, 200)
        self.pub.bind(pub_endpoint)
        self.endpoint = E.connect_address(self.router.getsockopt_string(zmq.LAST_ENDPOINT))
        self.pub_endpoint = E.connect_address(self.pub.getsockopt_string(zmq.LAST_ENDPOINT))
        if self.cfg.disagg.role:
            self.disagg = Disaggregation(self.cfg.disagg, self.engine, self.ctx, self.cfg.token,
                                         self.cfg.allow_remote, self._wake)  # fmt: skip
        info = {
            k: v for k, v in self.engine.model_info().items() if k in P.ModelInfo.__struct_fields__
        }
        if self.disagg is not None:
            info |= {"role": self.cfg.disagg.role,
                     "kv_transfer_endpoint": self.disagg.transfer_endpoint}  # fmt: skip
        info["kv_groups"] = [P.KVGroup(**g) for g in info.get("kv_groups", [])]
        self._model_info = P.ModelInfo(**info)
        self._start_vllm_events()
        if (self.cfg.kv_events or self.vllm_events) and hasattr(self.engine, "enable_kv_events"):
            self.engine.enable_kv_events()
        return self.endpoint, self.pub_endpoint

    def request_stop(self, reason: str) -> None:
        """Ask the loop to shut down (safe from a signal handler or another thread)."""
        if self._stop_reason is None:
            self._stop_reason = reason
        self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    # ---------------------------------------------------------------- main loop

    def serve_forever(self) -> int:
        assert self.router is not None and self.pub is not None, "call bind() first"
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self._wake_r.fileno(), zmq.POLLIN)
        replay = self.vllm_events.replay if self.vllm_events is not None else None
        if replay is not None:
            poller.register(replay, zmq.POLLIN)
        try:
            while self._stop_reason is None:
                busy = self._busy()
                timeout_ms = 0 if busy else self._idle_timeout_ms()
                ready = dict(poller.poll(timeout_ms))
                if self._wake_r.fileno() in ready:
                    self._drain_wake()
                if replay is not None and replay in ready:
                    self.vllm_events.service_replay()  # type: ignore[union-attr]
                if self.disagg is not None:
                    self._admit_pulled()
                if self.router in ready or busy:
                    self._drain_router()
                if self._stop_reason is not None:
                    break
                if self._busy():
                    self._step()
                self._timers()
        finally:
            self._shutdown(self._stop_reason or "engine stopping")
        return 0

    def _busy(self) -> bool:
        return not self.paused and self.engine.has_unfinished_requests()

    def _idle_timeout_ms(self) -> int:
        now = time.monotonic()
        next_hb = self._last_heartbeat + self.cfg.heartbeat_interval
        period = 1.0 / (
            self.cfg.telemetry_hz if self._telemetry_dirty else self.cfg.idle_telemetry_hz
        )
        next_tel = self._last_telemetry + period
        return max(0, min(1000, int((min(next_hb, next_tel) - now) * 1000) + 1))

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # an engine bug must not kill the loop or leak requests
            log.exception("engine.step() failed; aborting every request in flight")
            self._abort_all(f"engine error: {exc}", reason="error")
            return
        self._dispatch(outputs)
        self._send_refusals()
        self._reap_dead()
        self._telemetry_dirty = True

    def _timers(self) -> None:
        now = time.monotonic()
        busy = self._busy()
        hz = (
            self.cfg.telemetry_hz if (busy or self._telemetry_dirty) else self.cfg.idle_telemetry_hz
        )
        if now - self._last_telemetry >= 1.0 / hz:
            self._publish_telemetry()
        if self.disagg is not None:
            self.disagg.tick()
        if now - self._last_heartbeat >= self.cfg.heartbeat_interval:
            self._last_heartbeat = now
            self._heartbeat(now)
            # A long step leaves heartbeats queued unread: read them before judging silence.
            self._drain_router()
            self._expire_clients(time.monotonic())

    # ---------------------------------------------------------------- inbound

    def _drain_router(self) -> None:
        assert self.router is not None
        for _ in range(MAX_MESSAGES_PER_TURN):
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                break
            try:
                self._handle_frames(frames)
            except Exception as exc:  # never let one message kill the loop
                log.exception("internal error handling a message")
                if frames:
                    rid, ctl = ids_of_undecodable(frames[-1]) if len(frames) > 1 else (None, None)
                    self._send_error(frames[0], P.ERR_INTERNAL, f"internal error: {exc}", rid, ctl)
        self._reap_dead()

    def _handle_frames(self, frames: list[bytes]) -> None:
        cid = frames[0]
        client = self._clients.get(cid)
        now = time.monotonic()
        if client is None:
            client = self._clients[cid] = Client(routing_id=cid, last_seen=now)
        client.last_seen = now
        if len(frames) != 2:
            self._send_error(
                cid, P.ERR_BAD_MESSAGE, f"expected 1 frame per message, got {len(frames) - 1}"
            )
            return
        try:
            msg = P.decode_client(frames[1])
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            err = P.classify_decode_error(exc, frames[1])
            rid, ctl = ids_of_undecodable(frames[1])
            self._send_error(cid, err.code, err.message, request_id=rid, control_id=ctl)
            return
        if self.cfg.token is not None and not (
            isinstance(msg.token, str) and hmac.compare_digest(msg.token, self.cfg.token)
        ):
            self._send_error(
                cid,
                P.ERR_UNAUTHORIZED,
                "missing or wrong token",
                request_id=getattr(msg, "request_id", None),
                control_id=getattr(msg, "control_id", None),
            )
            return
        handler = _HANDLERS[type(msg)]
        handler(self, client, msg)

    def _on_hello(self, client: Client, msg: P.Hello) -> None:
        if msg.protocol_version != P.PROTOCOL_VERSION:
            self._send_error(
                client.routing_id,
                P.ERR_VERSION_MISMATCH,
                f"protocol_version must be {P.PROTOCOL_VERSION}, got {msg.protocol_version}",
            )
            return
        client.name = msg.client_name
        assert self._model_info is not None
        self._send(
            client.routing_id,
            P.Welcome(
                protocol_version=P.PROTOCOL_VERSION,
                client_id=client.routing_id.hex(),
                model=self._model_info,
                config=self._live_config(),
                pub_endpoint=self.pub_endpoint,
                telemetry_hz=self.cfg.telemetry_hz,
                heartbeat_interval=self.cfg.heartbeat_interval,
                client_timeout=self.cfg.client_timeout,
                max_message_bytes=P.MAX_CLIENT_MESSAGE_BYTES,
                server_time=time.monotonic(),
            ),
        )

    def _on_generate(self, client: Client, msg: P.Generate) -> None:
        from engine_proc.sampling_params import SamplingParams

        cid, rid = client.routing_id, msg.request_id
        if self._stop_reason is not None:
            self._send_error(
                cid, P.ERR_SHUTTING_DOWN, "the engine is shutting down", request_id=rid
            )
            return
        if rid in self._inflight:
            self._send_error(
                cid,
                P.ERR_DUPLICATE_REQUEST_ID,
                f"request_id {rid!r} is already in flight",
                request_id=rid,
            )
            return
        if len(self._inflight) >= self.cfg.max_pending:
            self._send_error(
                cid,
                P.ERR_OVERLOADED,
                f"{len(self._inflight)} requests in flight (max_pending)",
                request_id=rid,
            )
            return
        kv = msg.kv_transfer
        why = None
        if kv is not None:
            why = "this engine serves whole requests (no --role)" if self.disagg is None else (
                self.disagg.refusal(kv))
        if why is not None:
            self._send_error(cid, P.ERR_INVALID_REQUEST, why, request_id=rid)
            return
        try:
            params = SamplingParams(**P.sampling_to_dict(msg.sampling))
        except ValueError as exc:
            self._send_error(cid, P.ERR_INVALID_REQUEST, str(exc), request_id=rid)
            return
        if msg.messages is not None:
            prompt: Any = ChatPrompt(message_dicts(msg.messages), msg.tools,
                                     msg.chat_template_kwargs)  # fmt: skip
        else:
            prompt = msg.prompt
        if kv is not None and kv.remote_endpoint is not None:
            assert self.disagg is not None
            pending = PendingPull(cid, prompt, params, msg.cache_salt,
                                  list(kv.output_token_ids), time.monotonic())  # fmt: skip
            if self.disagg.start_pull(rid, kv, pending):
                self._track(client, rid, params.n)
                return
        transfer = self.disagg.request_of(kv) if kv is not None and self.disagg else None
        if self._admit(cid, rid, prompt, params, msg.cache_salt, transfer):
            self._track(client, rid, params.n)

    def _on_heartbeat(self, client: Client, msg: P.Heartbeat) -> None:
        pass  # last_seen was updated on receipt

    def _extra_counters(self) -> dict[str, float]:
        return self.disagg.counters() if self.disagg is not None else {}

    def _live_config(self) -> P.LiveConfig:
        return live_config_of(self.engine.live_config(), self.paused)

    # ---------------------------------------------------------------- shutdown

    def _shutdown(self, why: str) -> None:
        log.info("shutting down: %s", why)
        try:
            self._drain_router()  # answer what already arrived (new generates get shutting_down)
            self._abort_all(f"engine shutting down: {why}")
            for cid in list(self._clients):
                self._send(cid, P.Goodbye(reason=why))
            self._publish_telemetry()
            self._publish(P.TOPIC_GOODBYE, P.Goodbye(reason=why))
        except Exception:
            log.exception("error while shutting down")
        finally:
            self.close()

    def close(self) -> None:
        if self.disagg is not None:
            self.disagg.close()
        if self.vllm_events is not None:
            self.vllm_events.close()
        for s in (self.router, self.pub):
            if s is not None and not s.closed:
                s.close()
        self._wake_r.close()
        self._wake_w.close()
        if self._own_ctx:
            self.ctx.term()
        if self._runtime_dir is not None:
            shutil.rmtree(self._runtime_dir, ignore_errors=True)


_HANDLERS = {
    P.Hello: EngineServer._on_hello,
    P.Generate: EngineServer._on_generate,
    P.Tokenize: EngineServer._on_tokenize,
    P.Detokenize: EngineServer._on_detokenize,
    P.Abort: EngineServer._on_abort,
    P.Control: EngineServer._on_control,
    P.Heartbeat: EngineServer._on_heartbeat,
    P.Goodbye: EngineServer._on_goodbye,
}

