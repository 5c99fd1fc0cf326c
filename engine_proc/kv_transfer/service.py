"""KV block transfer over ZeroMQ (ipc/kv_transfer.py has the wire format).

`TransferServer` (prefill role) answers pulls on a thread of its own, so a pull never waits for
the engine's step (on a CPU a prompt step takes seconds): it only reads leased blocks, which
nothing writes while the lease holds them, under the lease table's lock (engine_proc/
kv_transfer.py KVLeases); blocks of a pulled lease go back to the pool from the engine loop.
`KVPuller` (decode role) pulls on a thread of its own, so running streams keep decoding while a
prompt's blocks are on their way; the loop adopts the received bytes once a pull completes.
"""

from __future__ import annotations

import hmac
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from ipc import endpoints as E
from ipc import kv_transfer as T

log = logging.getLogger(__name__)

TRANSFER_SNDHWM = 1_000_000  # blocks queued towards pullers (a pull never waits on the loop)
FAULTS = ("", "drop", "corrupt")  # test hooks: never answer pulls, or flip a byte in each block


class TransferServer:
    """The prefill engine's transfer ROUTER."""

    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        transfer: Any,  # engine.transfer (engine_proc/kv_transfer/transfer.py)
        identity: str,
        token: str | None,
        allow_remote: bool = False,
        fault: str = "",
        wake: Callable[[], None] | None = None,  # the engine loop: a pulled lease to collect
    ) -> None:
        if fault not in FAULTS:
            raise ValueError(f"kv_transfer_fault must be one of {FAULTS}, got {fault!r}")
        E.check_bind(endpoint, allow_remote, token)
        self.transfer = transfer
        self.identity = identity
        self.token = token
        self.fault = fault
        self.wake = wake
        self.socket = ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.MAXMSGSIZE, T.MAX_PULL_MESSAGE_BYTES)
        self.socket.setsockopt(zmq.SNDHWM, TRANSFER_SNDHWM)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(endpoint)
        self.endpoint = E.connect_address(self.socket.getsockopt_string(zmq.LAST_ENDPOINT))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Serve pulls on a thread (the socket is that thread's alone from now on)."""
        self._thread = threading.Thread(target=self._run, name="kv-transfer-server", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if poller.poll(100):
                    self.drain()
            except zmq.ZMQError as exc:  # the context is closing
                log.info("KV transfer server stops: %s", exc)
                return
            except Exception:  # an engine bug: the puller times out and recomputes
                log.exception("KV transfer server failed to answer a pull")

    def drain(self, limit: int = 64) -> None:
        for _ in range(limit):
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._serve(frames)
            except zmq.ZMQError as exc:  # the puller is gone: it recomputes
                log.info("KV transfer to a puller failed: %s", exc)

    def _serve(self, frames: list[bytes]) -> None:
        peer = frames[0]
        if len(frames) != 2:
            self._done(peer, "", 0, T.PULL_BAD_MESSAGE, f"expected 1 frame, got {len(frames) - 1}")
            return
        try:
            msg = T.decode(frames[1])
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._done(peer, "", 0, T.PULL_BAD_MESSAGE, f"not a kv_pull: {exc}")
            return
        if not isinstance(msg, T.KVPull):
            self._done(peer, "", 0, T.PULL_BAD_MESSAGE, f"expected kv_pull, got {type(msg)}")
            return
        if self.token is not None and not (
            isinstance(msg.token, str) and hmac.compare_digest(msg.token, self.token)
        ):
            self._done(peer, msg.lease_id, 0, T.PULL_UNAUTHORIZED, "missing or wrong token")
            return
        if msg.cache_identity != self.identity:
            self._done(peer, msg.lease_id, 0, T.PULL_IDENTITY_MISMATCH,
                       f"this engine's KV is {self.identity!r}, the puller's "
                       f"{msg.cache_identity!r}")  # fmt: skip
            return
        if self.fault == "drop":
            return
        try:
            payloads = self.transfer.payloads(msg.lease_id, list(msg.block_hashes))
        except KeyError as exc:
            known = self.transfer.leases.holds(msg.lease_id)
            code = T.PULL_UNKNOWN_BLOCK if known else T.PULL_UNKNOWN_LEASE
            self._done(peer, msg.lease_id, 0, code, str(exc.args[0]))
            return
        for i, (h, payload) in enumerate(zip(msg.block_hashes, payloads, strict=True)):
            frames_out = T.block_frames(msg.lease_id, i, h, payload)
            if self.fault == "corrupt":
                frames_out[1] = bytes([payload[0] ^ 0xFF]) + payload[1:]
            self.socket.send_multipart([peer, *frames_out], zmq.NOBLOCK)
        if msg.release and self.transfer.leases.take(msg.lease_id) and self.wake is not None:
            self.wake()
        self._done(peer, msg.lease_id, len(payloads), T.PULL_OK, "")

    def _done(self, peer: bytes, lease_id: str, n: int, code: str, message: str) -> None:
        if code != T.PULL_OK:
            log.info("KV pull refused (%s): %s", code, message)
        done = T.KVPullDone(lease_id=lease_id, num_blocks=n, code=code, message=message)
        self.socket.send_multipart([peer, T.encode(done)], zmq.NOBLOCK)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self.socket.close(0)


@dataclass(slots=True)
class PullJob:
    request_id: str
    endpoint: str
    lease_id: str
    block_hashes: list[bytes]  # empty: only end the lease (the pool already has every block)


@dataclass(slots=True)
class PullResult:
    request_id: str
    release_only: bool = False
    payloads: dict[bytes, bytes] = field(default_factory=dict)
    error: str = ""  # why nothing usable came back ('' = every block arrived intact)
    seconds: float = 0.0
    num_bytes: int = 0


class KVPuller:
    """A thread that pulls leased blocks, one job at a time, and hands results to the loop."""

    def __init__(
        self,
        ctx: zmq.Context,
        identity: str,
        block_bytes: int,
        token: str | None,
        timeout: float,
        wake: Callable[[], None],
    ) -> None:
        if not timeout > 0:
            raise ValueError(f"kv_transfer_timeout must be > 0, got {timeout!r}")
        self.ctx = ctx
        self.identity = identity
        self.block_bytes = block_bytes
        self.token = token
        self.timeout = timeout
        self.wake = wake
        self.jobs: queue.Queue[PullJob | None] = queue.Queue()
        self.results: queue.Queue[PullResult] = queue.Queue()
        self._sockets: dict[str, zmq.Socket] = {}
        self._thread = threading.Thread(target=self._run, name="kv-puller", daemon=True)
        self._thread.start()

    def submit(self, job: PullJob) -> None:
        self.jobs.put(job)

    def close(self) -> None:
        self.jobs.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        try:
            while (job := self.jobs.get()) is not None:
                t0 = time.monotonic()
                try:
                    result = self._pull(job)
                except Exception as exc:  # never lose a request: it recomputes
                    log.exception("KV pull for %s failed", job.request_id)
                    result = PullResult(job.request_id, not job.block_hashes,
                                        error=f"internal error: {exc}")  # fmt: skip
                result.seconds = time.monotonic() - t0
                self.results.put(result)
                self.wake()
        finally:
            for s in self._sockets.values():
                s.close(0)

    def _socket(self, endpoint: str) -> zmq.Socket:
        s = self._sockets.get(endpoint)
        if s is None:
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.MAXMSGSIZE, self.block_bytes + 4096)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RCVHWM, 0)
            s.connect(endpoint)
            self._sockets[endpoint] = s
        return s

    def _drop_socket(self, endpoint: str) -> None:
        s = self._sockets.pop(endpoint, None)
        if s is not None:
            s.close(0)  # a late reply of this pull must not reach the next one

    def _pull(self, job: PullJob) -> PullResult:
        s = self._socket(job.endpoint)
        pull = T.KVPull(lease_id=job.lease_id, block_hashes=job.block_hashes,
                        cache_identity=self.identity, token=self.token)  # fmt: skip
        s.send(T.encode(pull))
        deadline = time.monotonic() + self.timeout
        result = PullResult(job.request_id, release_only=not job.block_hashes)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not s.poll(int(left * 1000) + 1):
                self._drop_socket(job.endpoint)
                result.error = f"no reply from {job.endpoint} within {self.timeout:g} s"
                result.payloads.clear()
                return result
            frames = s.recv_multipart()
            why = self._take(frames, job, result)
            if why is None:
                continue
            if why:
                result.error = why
                result.payloads.clear()
                self._drop_socket(job.endpoint)
            return result

    def _take(self, frames: list[bytes], job: PullJob, result: PullResult) -> str | None:
        """Fold one message into result: None = more to come, '' = done, else why it failed."""
        try:
            msg = T.decode(frames[0])
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return f"malformed transfer message: {exc}"
        if msg.lease_id != job.lease_id:
            return None  # a late message of an earlier pull
        if isinstance(msg, T.KVPullDone):
            if msg.code != T.PULL_OK:
                return f"{msg.code}: {msg.message}"
            if len(result.payloads) != len(job.block_hashes):
                return f"{len(result.payloads)} of {len(job.block_hashes)} blocks arrived"
            return ""
        if not isinstance(msg, T.KVBlockHeader) or len(frames) != 2:
            return f"unexpected transfer message {type(msg).__name__}"
        if not 0 <= msg.index < len(job.block_hashes):
            return f"block index {msg.index} out of range"
        why = T.check_block(msg, frames[1], job.block_hashes[msg.index], self.block_bytes)
        if why:
            return why
        result.payloads[msg.block_hash] = frames[1]
        result.num_bytes += len(frames[1])
        return None
