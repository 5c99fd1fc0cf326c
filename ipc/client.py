"""Clients of the KVScope engine (plain Python; no torch, Qt or engine_proc).

Three layers, pick one:
- `EngineConnection` (ipc/connection.py): one thread, non-blocking, you drive the polling.
- `EngineClient`: thread-safe. A background I/O thread owns an EngineConnection and routes
  replies to per-request queues; `generate()` / `chat()` return a `RequestStream` iterator of
  `Delta`s ending with the `Finish` (one per sequence). Any number of threads may stream at once.
- `TelemetrySubscriber` (ipc/connection.py): a SUB socket for the engine's PUB.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import zmq

from ipc import protocol as P
from ipc.connection import (
    ERR_CLIENT_CLOSED,
    ERR_ENGINE_GONE,
    EngineConnection,
    EngineError,
    TelemetrySubscriber,
    chat_messages,
    make_sampling,
    new_request_id,
)

__all__ = [
    "ERR_CLIENT_CLOSED",
    "ERR_ENGINE_GONE",
    "EngineClient",
    "EngineConnection",
    "EngineError",
    "RequestStream",
    "TelemetrySubscriber",
    "make_sampling",
    "new_request_id",
]

log = logging.getLogger(__name__)


# ============================================================== thread-safe client


class RequestStream:
    """Iterator over one request's replies: Delta ... then one Finish per sequence (n).

    Raises EngineError when the engine refuses the request or goes away. `text` /
    `token_ids` accumulate what was yielded (sequence 0; `texts` for all).
    """

    def __init__(self, client: EngineClient, request_id: str, n: int) -> None:
        self.request_id = request_id
        self.n = n
        self.texts: dict[int, str] = {}
        self.token_ids_by_index: dict[int, list[int]] = {}
        self.finishes: dict[int, P.Finish] = {}
        self._client = client
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._done = False

    @property
    def text(self) -> str:
        return self.texts.get(0, "")

    @property
    def token_ids(self) -> list[int]:
        return self.token_ids_by_index.get(0, [])

    @property
    def finish(self) -> P.Finish | None:
        return self.finishes.get(0)

    @property
    def done(self) -> bool:
        return self._done

    def __iter__(self) -> Iterator[P.Delta | P.Finish]:
        return self

    def __next__(self) -> P.Delta | P.Finish:
        msg = self.next_event()
        assert msg is not None
        return msg

    def next_event(self, timeout: float | None = None) -> P.Delta | P.Finish | None:
        """The next Delta/Finish; None after `timeout` s (0 = don't wait); StopIteration at end."""
        if self._done:
            raise StopIteration
        try:
            msg = self._queue.get(timeout=timeout) if timeout != 0 else self._queue.get_nowait()
        except queue.Empty:
            return None
        if isinstance(msg, P.Delta):
            self.texts[msg.index] = self.texts.get(msg.index, "") + msg.text
            self.token_ids_by_index.setdefault(msg.index, []).extend(msg.token_ids)
            return msg
        if isinstance(msg, P.Finish):
            self.finishes[msg.index] = msg
            if len(self.finishes) >= self.n:
                self._finish()
            return msg
        assert isinstance(msg, EngineError), msg
        self._finish()
        raise msg

    def drain(self) -> list[P.Delta | P.Finish]:
        """Everything already received, without waiting."""
        out: list[P.Delta | P.Finish] = []
        while not self._done and (msg := self.next_event(0)) is not None:
            out.append(msg)
        return out

    def result(self, timeout: float | None = None) -> RequestStream:
        """Consume the stream to its end; returns self (text, token_ids, finishes filled)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._done:
            left = None if deadline is None else max(1e-3, deadline - time.monotonic())
            if self.next_event(left) is None:
                raise TimeoutError(f"request {self.request_id} not finished in {timeout} s")
        return self

    def abort(self) -> None:
        if not self._done:
            self._client.abort(self.request_id)

    def _finish(self) -> None:
        self._done = True
        self._client._forget(self.request_id)

    def _put(self, msg: Any) -> None:
        self._queue.put(msg)


class EngineClient:
    """Thread-safe client: one background I/O thread owns the sockets.

    >>> with EngineClient("tcp://127.0.0.1:5557") as client:
    ...     for ev in client.chat([{"role": "user", "content": "Hi"}], temperature=0):
    ...         print(getattr(ev, "text", ""), end="", flush=True)
    """

    def __init__(
        self,
        endpoint: str,
        *,
        token: str | None = None,
        client_name: str = "",
        connect_timeout: float = 60.0,
        engine_timeout: float | None = None,
        context: zmq.Context | None = None,
    ) -> None:
        self.endpoint = endpoint
        self._ctx = context or zmq.Context.instance()
        self._lock = threading.Lock()
        self._streams: dict[str, RequestStream] = {}
        self._controls: dict[str, queue.SimpleQueue[Any]] = {}
        self._outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._closed = False
        self._closing_reason = ""
        self._engine_gone = ""  # why new requests fail at once (the engine said goodbye)
        self._welcome_q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._engine_timeout = engine_timeout
        self._ids = itertools.count()
        self._conn_args = dict(token=token, client_name=client_name, context=self._ctx)
        self._thread = threading.Thread(
            target=self._io_loop, name="kvscope-ipc-client", daemon=True
        )
        self._thread.start()
        self._submit(("hello",))
        try:
            got = self._welcome_q.get(timeout=connect_timeout)
        except queue.Empty:
            self.close()
            raise EngineError(
                ERR_ENGINE_GONE, f"no welcome from {endpoint} within {connect_timeout} s"
            ) from None
        if isinstance(got, EngineError):
            self.close()
            raise got
        self.welcome: P.Welcome = got
        if self._engine_timeout is None:
            self._engine_timeout = max(3 * got.heartbeat_interval, got.client_timeout)

    # ---------------------------------------------------------------- public API

    @property
    def model_info(self) -> P.ModelInfo:
        return self.welcome.model

    @property
    def pub_endpoint(self) -> str:
        return self.welcome.pub_endpoint

    def generate(
        self,
        prompt: str | list[int],
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        sampling: P.SamplingOptions | dict[str, Any] | None = None,
        **sampling_fields: Any,
    ) -> RequestStream:
        return self._start(
            request_id, prompt, None, make_sampling(sampling, **sampling_fields), cache_salt
        )

    def chat(
        self,
        messages: Sequence[Any],
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        sampling: P.SamplingOptions | dict[str, Any] | None = None,
        **sampling_fields: Any,
    ) -> RequestStream:
        msgs = chat_messages(messages)
        return self._start(
            request_id, None, msgs, make_sampling(sampling, **sampling_fields), cache_salt
        )

    def abort(self, request_id: str) -> None:
        self._submit(("send", P.Abort(request_id=request_id)))

    def control(self, op: str, timeout: float = 30.0, **fields: Any) -> P.ControlAck:
        """Send a control and wait for its ControlAck (EngineError on an `error`)."""
        control_id = f"c{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        msg = P.Control(op=op, control_id=control_id, **fields)  # type: ignore[arg-type]
        q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        with self._lock:
            self._check_open()
            self._controls[control_id] = q
        self._submit(("send", msg))
        try:
            got = q.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no reply to control {op!r} within {timeout} s") from None
        finally:
            with self._lock:
                self._controls.pop(control_id, None)
        if isinstance(got, EngineError):
            raise got
        return got

    def get_config(self) -> P.LiveConfig:
        return self.control("get_config").config

    def set_limits(self, **limits: int) -> P.LiveConfig:
        return self.control("set_limits", **limits).config

    def set_prefix_caching(self, enabled: bool) -> P.LiveConfig:
        return self.control("set_prefix_caching", enable_prefix_caching=enabled).config

    def reset_prefix_cache(self) -> bool:
        return bool(self.control("reset_prefix_cache").result)

    def pause(self) -> P.LiveConfig:
        return self.control("pause").config

    def resume(self) -> P.LiveConfig:
        return self.control("resume").config

    def shutdown(self) -> P.ControlAck:
        return self.control("shutdown")

    def subscribe_telemetry(self, **kwargs: Any) -> TelemetrySubscriber:
        """A new TelemetrySubscriber on the engine's PUB (owned by the calling thread)."""
        return TelemetrySubscriber(self.pub_endpoint, context=self._ctx, **kwargs)

    def close(self) -> None:
        """Say goodbye (the engine aborts our requests), stop the I/O thread, close sockets."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._submit(("close",), force=True)
        self._thread.join(timeout=5.0)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- internals

    def _check_open(self) -> None:
        if self._closed:
            raise EngineError(ERR_CLIENT_CLOSED, self._closing_reason or "client is closed")
        if self._engine_gone:
            raise EngineError(ERR_ENGINE_GONE, self._engine_gone)

    def _start(
        self,
        request_id: str | None,
        prompt: str | list[int] | None,
        messages: list[P.ChatMessage] | None,
        opts: P.SamplingOptions,
        cache_salt: str | None,
    ) -> RequestStream:
        request_id = request_id or new_request_id()
        msg = P.Generate(
            request_id=request_id,
            prompt=prompt,
            messages=messages,
            sampling=opts,
            cache_salt=cache_salt,
        )
        stream = RequestStream(self, request_id, max(1, opts.n))
        with self._lock:
            self._check_open()
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already streaming on this client")
            self._streams[request_id] = stream  # registered before sending: no reply is lost
        self._submit(("generate", msg))
        return stream

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)

    def _submit(self, item: tuple, force: bool = False) -> None:
        if not force and self._closed and item[0] != "hello":
            raise EngineError(ERR_CLIENT_CLOSED, self._closing_reason or "client is closed")
        self._outbox.put(item)
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def _io_loop(self) -> None:
        try:
            conn = EngineConnection(self.endpoint, **self._conn_args)  # type: ignore[arg-type]
        except (zmq.ZMQError, ValueError) as exc:
            self._engine_gone = f"cannot connect to {self.endpoint!r}: {exc}"
            self._welcome_q.put(EngineError(ERR_ENGINE_GONE, self._engine_gone))
            return
        poller = zmq.Poller()
        poller.register(conn.dealer, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        running = True
        try:
            while running:
                timeout = int(conn.heartbeat_interval * 1000 / 2) if conn.active_requests else 1000
                poller.poll(timeout)
                try:
                    while os.read(self._wake_r, 4096):
                        pass
                except (BlockingIOError, OSError):
                    pass
                running = self._flush_outbox(conn)
                for msg in conn.poll(0):
                    self._route(msg)
                self._check_engine_alive(conn)
        except Exception:  # the I/O thread must never die silently
            log.exception("EngineClient I/O thread failed")
            self._fail_all(EngineError(ERR_ENGINE_GONE, "client I/O thread failed"))
        finally:
            self._fail_all(EngineError(ERR_CLIENT_CLOSED, "client closed"))
            conn.close(goodbye=True)

    def _flush_outbox(self, conn: EngineConnection) -> bool:
        while True:
            try:
                item = self._outbox.get_nowait()
            except queue.Empty:
                return True
            kind = item[0]
            if kind == "close":
                return False
            try:
                if kind == "hello":
                    conn.send_hello()
                elif kind == "generate":
                    msg = item[1]
                    conn.track_request(msg.request_id, msg.sampling.n)
                    conn.send(msg)
                else:
                    conn.send(item[1])
            except (ValueError, zmq.ZMQError, EngineError) as exc:
                rid = getattr(item[1], "request_id", None) if len(item) > 1 else None
                if isinstance(exc, EngineError):
                    err = EngineError(exc.code, exc.message, rid)
                else:
                    err = EngineError(P.ERR_INVALID_MESSAGE, str(exc), rid)
                if kind == "generate":
                    conn._active.pop(rid, None)
                self._route_error(
                    err, rid, getattr(item[1], "control_id", None) if len(item) > 1 else None
                )

    def _route(self, msg: Any) -> None:
        if isinstance(msg, P.Welcome):
            self._welcome_q.put(msg)
        elif isinstance(msg, P.Delta | P.Finish):
            with self._lock:
                stream = self._streams.get(msg.request_id)
            if stream is not None:
                stream._put(msg)
        elif isinstance(msg, P.ControlAck):
            with self._lock:
                q = self._controls.get(msg.control_id)
            if q is not None:
                q.put(msg)
        elif isinstance(msg, P.Error):
            err = EngineError(msg.code, msg.message, msg.request_id)
            if msg.request_id is None and msg.control_id is None:
                self._welcome_q.put(err)  # only read during the handshake
                log.warning("engine error: %s", err)
            if msg.code == P.ERR_UNKNOWN_REQUEST:
                return  # a refused abort: the request (if any) still ends with its finish
            self._route_error(err, msg.request_id, msg.control_id)
        elif isinstance(msg, P.Goodbye):
            self._engine_gone = f"engine said goodbye: {msg.reason}"
            self._fail_all(EngineError(ERR_ENGINE_GONE, self._engine_gone))

    def _route_error(
        self, err: EngineError, request_id: str | None, control_id: str | None
    ) -> None:
        with self._lock:
            stream = self._streams.get(request_id) if request_id else None
            q = self._controls.get(control_id) if control_id else None
        if stream is not None:
            stream._put(err)
        if q is not None:
            q.put(err)

    def _check_engine_alive(self, conn: EngineConnection) -> None:
        if not conn.active_requests or self._engine_timeout is None:
            return
        silent = conn.engine_silence()
        if silent > self._engine_timeout:
            err = EngineError(ERR_ENGINE_GONE, f"no message from the engine for {silent:.1f} s")
            for rid in list(conn.active_requests):
                conn._active.pop(rid, None)
            self._fail_all(err)

    def _fail_all(self, err: EngineError) -> None:
        with self._lock:
            streams = list(self._streams.values())
            controls = list(self._controls.values())
        for s in streams:
            s._put(err)
        for q in controls:
            q.put(err)
