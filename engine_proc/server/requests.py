"""The engine server's clients and their requests in flight: admitting a request to the engine,
sending replies, turning each step's outputs into Delta and Finish messages, aborting, and
dropping clients that left, stopped reading or went silent. A mixin of EngineServer
(engine_proc/server/engine_server.py), which owns the state it reads."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from engine_proc.kv_transfer.transfer import KVTransferRequest
from engine_proc.server.config import ServerConfig
from engine_proc.server.disagg import Disaggregation
from engine_proc.server.wire import delta_of, finish_of, synthetic_finish
from ipc import protocol as P

log = logging.getLogger("engine_proc.server")


@dataclass(slots=True)
class Client:
    routing_id: bytes
    last_seen: float
    requests: set[str] = field(default_factory=set)
    name: str = ""


@dataclass(slots=True)
class InFlight:
    client: bytes
    n: int  # sequences: one Finish each
    finished: set[int] = field(default_factory=set)  # sequence indices already finished
    abort_message: str | None = None  # why the server aborted it, once it did


class RequestTracking:
    """Every request in flight belongs to one client: when the client goes, its requests are
    aborted, and each sequence of a request gets exactly one Finish."""

    engine: Any
    cfg: ServerConfig
    router: zmq.Socket | None
    disagg: Disaggregation | None
    _clients: dict[bytes, Client]
    _inflight: dict[str, InFlight]
    _dead: set[bytes]
    _telemetry_dirty: bool

    def _track(self, client: Client, rid: str, n: int) -> None:
        self._inflight[rid] = InFlight(client=client.routing_id, n=n)
        client.requests.add(rid)
        self._telemetry_dirty = True

    def _admit(
        self, cid: bytes, rid: str, prompt: Any, params: Any, cache_salt: str | None,
        kv_transfer: KVTransferRequest | None = None,
    ) -> bool:  # fmt: skip
        """Hand a request to the engine; False (the client told why) when it refuses."""
        try:
            if kv_transfer is None:
                self.engine.add_request(rid, prompt, params, cache_salt=cache_salt)
            else:
                self.engine.add_request(rid, prompt, params, cache_salt=cache_salt,
                                        kv_transfer=kv_transfer)  # fmt: skip
        except ValueError as exc:
            self._send_error(cid, P.ERR_INVALID_REQUEST, str(exc), request_id=rid)
            return False
        except Exception as exc:  # an engine bug: the client still hears about its request
            log.exception("add_request failed for %r", rid)
            self._send_error(cid, P.ERR_INTERNAL, f"internal error: {exc}", request_id=rid)
            if self._engine_knows(rid) and getattr(self.engine, "requests", None) is not None:
                try:
                    self.engine.abort_request(rid)
                except Exception:
                    log.exception("could not abort %r after a failed add_request", rid)
            return False
        return True

    def _admit_pulled(self) -> None:
        """Decode role: admit the requests whose pull ended (a prefill engine's pulls are
        answered on the transfer server's own thread)."""
        assert self.disagg is not None
        for rid, pending, result in self.disagg.completed():
            if rid not in self._inflight:
                continue  # aborted while its blocks were on their way
            if result.error and self.cfg.disagg.transfer_failure == "fail":
                self._send_error(pending.client, P.ERR_KV_TRANSFER_FAILED,
                                 f"KV transfer failed: {result.error}", request_id=rid)  # fmt: skip
                self._forget(rid)
                continue
            transfer = KVTransferRequest(output_token_ids=pending.output_token_ids,
                                         payloads=result.payloads)  # fmt: skip
            if not self._admit(pending.client, rid, pending.prompt, pending.params,
                               pending.cache_salt, transfer):  # fmt: skip
                self._forget(rid)
            self._telemetry_dirty = True

    def _on_abort(self, client: Client, msg: P.Abort) -> None:
        rid = msg.request_id
        if rid not in self._inflight:
            self._send_error(
                client.routing_id,
                P.ERR_UNKNOWN_REQUEST,
                f"request_id {rid!r} is not in flight",
                request_id=rid,
            )
            return
        self._abort(rid, "aborted by a client")

    def _on_goodbye(self, client: Client, msg: P.Goodbye) -> None:
        self._drop_client(
            client.routing_id,
            f"client said goodbye: {msg.reason}" if msg.reason else "client said goodbye",
        )

    # ---------------------------------------------------------------- outbound

    def _send(self, cid: bytes, msg: msgspec.Struct) -> bool:
        assert self.router is not None
        if cid in self._dead:
            return False
        try:
            self.router.send_multipart([cid, P.encode(msg)], zmq.NOBLOCK)
            return True
        except zmq.ZMQError as exc:
            # EHOSTUNREACH: the client is gone. EAGAIN: it stopped reading (ROUTER_SNDHWM full).
            log.info("client %s unreachable (%s); its requests will be aborted", cid.hex(), exc)
            self._dead.add(cid)
            return False

    def _send_error(
        self,
        cid: bytes,
        code: str,
        message: str,
        request_id: str | None = None,
        control_id: str | None = None,
    ) -> None:
        assert code in P.ERROR_CODES, code
        log.debug("error to %s: %s %s", cid.hex(), code, message)
        self._send(
            cid, P.Error(code=code, message=message, request_id=request_id, control_id=control_id)
        )

    def _dispatch(self, outputs: list[Any]) -> None:
        partly_finished: dict[str, Any] = {}
        for out in outputs:
            fl = self._inflight.get(out.request_id)
            if fl is None:
                continue  # a request whose client is gone (already aborted in the engine)
            if out.new_token_ids or out.text_delta:
                self._send(fl.client, delta_of(out))
            if out.finish_reason is not None and out.index not in fl.finished:
                finish = finish_of(out, fl.abort_message)
                if self.disagg is not None:
                    finish.kv_handoff = self.disagg.handoff(out)
                self._send(fl.client, finish)
                fl.finished.add(out.index)
                if len(fl.finished) >= fl.n:
                    self._forget(out.request_id)
                    partly_finished.pop(out.request_id, None)
                else:
                    partly_finished[out.request_id] = out
        # Only once the whole step is sent (its other sequences may finish later in `outputs`):
        # a request the engine no longer knows ended before it forked into n sequences (an
        # error, an abort or a stop during prefill): finish the sequences that never started.
        for rid, out in partly_finished.items():
            if not self._engine_knows(rid):
                self._finish_missing(rid, out.finish_reason, out.error)

    def _send_refusals(self) -> None:
        """Requests the engine refused after admitting them (a grammar that did not compile):
        each gets the invalid_request error a refusal at admission would have got."""
        take = getattr(self.engine, "take_refusals", None)
        if take is None:
            return
        for rid, why in take().items():
            fl = self._inflight.get(rid)
            if fl is not None:
                self._send_error(fl.client, P.ERR_INVALID_REQUEST, why, request_id=rid)
                self._forget(rid)

    def _forget(self, rid: str) -> None:
        if self.disagg is not None:
            self.disagg.forget(rid)
        fl = self._inflight.pop(rid, None)
        if fl is not None:
            client = self._clients.get(fl.client)
            if client is not None:
                client.requests.discard(rid)

    def _abort(self, rid: str, why: str, reason: str = "abort") -> None:
        fl = self._inflight.get(rid)
        if fl is None:
            return
        fl.abort_message = why
        try:
            outputs = self.engine.abort_request(rid)
        except ValueError:
            outputs = []  # the engine no longer knows it (finished this very step)
        if reason != "abort":
            for o in outputs:
                o.finish_reason = reason
        self._dispatch(outputs)
        self._finish_missing(rid, reason, why)
        self._telemetry_dirty = True

    def _engine_knows(self, rid: str) -> bool:
        requests = getattr(self.engine, "requests", None)
        return True if requests is None else rid in requests

    def _finish_missing(self, rid: str, reason: str, why: str | None) -> None:
        """Send a Finish for each sequence of `rid` the engine will never report again."""
        fl = self._inflight.get(rid)
        if fl is None:
            return
        for index in range(fl.n):
            if index not in fl.finished:
                self._send(fl.client, synthetic_finish(rid, index, reason, why or reason))
        self._forget(rid)

    def _abort_all(self, why: str, reason: str = "abort") -> None:
        for rid in list(self._inflight):
            self._abort(rid, why, reason)

    def _drop_client(self, cid: bytes, why: str) -> None:
        client = self._clients.pop(cid, None)
        if client is None:
            return
        self._dead.add(cid)  # nothing more goes to it
        rids = list(client.requests)
        for rid in rids:
            self._abort(rid, why)
        # stays in _dead until _reap_dead: no finish goes to a client that left
        level = logging.INFO if rids else logging.DEBUG
        log.log(level, "client %s gone (%s); %d requests aborted", cid.hex(), why, len(rids))

    def _reap_dead(self) -> None:
        while self._dead:
            cid = next(iter(self._dead))
            if cid in self._clients:
                self._drop_client(cid, "client unreachable")
            self._dead.discard(cid)  # a client that comes back later is served again

    def _expire_clients(self, now: float) -> None:
        for cid, client in list(self._clients.items()):
            if now - client.last_seen > self.cfg.client_timeout:
                self._drop_client(cid, f"client silent for {now - client.last_seen:.1f} s")
