"""One-thread connection to the engine, the telemetry subscriber and the client-side errors
(plain Python; no torch, Qt or engine_proc).

- `EngineConnection`: one thread, non-blocking. Owns a DEALER (and optionally a SUB); you send with
  `submit_*` and drain everything with `poll(timeout_ms)` (or put `sockets()` in your own
  `zmq.Poller` and call `poll(0)` when one is readable). It sends heartbeats for you while you
  have requests in flight. Not thread-safe: use it from the thread that created it.
- `TelemetrySubscriber`: a SUB socket for the engine's PUB (telemetry snapshots, heartbeats).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec
import zmq

from ipc import protocol as P

log = logging.getLogger(__name__)


class EngineError(Exception):
    """The engine answered with an `error`, or the engine went away."""

    def __init__(self, code: str, message: str, request_id: str | None = None) -> None:
        super().__init__(f"[{code}] {message}")
        self.code = code
        self.message = message
        self.request_id = request_id


ERR_ENGINE_GONE = "engine_unreachable"  # client-side code: no word from the engine in time
ERR_CLIENT_CLOSED = "client_closed"  # client-side code: close() was called


def make_sampling(
    sampling: P.SamplingOptions | dict[str, Any] | None = None, **kwargs: Any
) -> P.SamplingOptions:
    """SamplingOptions from a dict and/or keywords (field names as SamplingParams)."""
    if isinstance(sampling, P.SamplingOptions):
        if kwargs:
            return msgspec.structs.replace(sampling, **_clean_sampling(kwargs))
        return sampling
    merged = {**(sampling or {}), **kwargs}
    return P.SamplingOptions(**_clean_sampling(merged))


def _clean_sampling(fields: dict[str, Any]) -> dict[str, Any]:
    unknown = set(fields) - set(P.SAMPLING_FIELDS)
    if unknown:
        raise ValueError(f"unknown sampling fields {sorted(unknown)}; allowed: {P.SAMPLING_FIELDS}")
    out = dict(fields)
    if isinstance(out.get("stop"), str):
        out["stop"] = [out["stop"]]
    for name in ("stop", "stop_token_ids"):
        if name in out and out[name] is not None:
            out[name] = list(out[name])
    return out


def new_request_id() -> str:
    return uuid.uuid4().hex


def chat_messages(messages: Sequence[Any]) -> list[P.ChatMessage]:
    out = []
    for m in messages:
        if isinstance(m, P.ChatMessage):
            out.append(m)
        else:
            out.append(P.ChatMessage(role=str(m["role"]), content=str(m["content"])))
    return out


# ============================================================== single-thread connection


class EngineConnection:
    """Non-blocking connection for one thread (e.g. a GUI worker thread)."""

    def __init__(
        self,
        endpoint: str,
        *,
        pub_endpoint: str | None = None,
        subscribe: bool = False,
        token: str | None = None,
        client_name: str = "",
        context: zmq.Context | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.token = token
        self.client_name = client_name
        self.welcome: P.Welcome | None = None
        self.heartbeat_interval = P.DEFAULT_HEARTBEAT_INTERVAL
        self.last_engine_message = time.monotonic()  # any frame from the engine, either socket
        self._ctx = context or zmq.Context.instance()
        self._active: dict[str, int] = {}  # request id -> sequences not yet finished
        self._last_heartbeat = 0.0
        self._pending: list[Any] = []  # received during hello(), handed out by the next poll()
        self.dealer = self._ctx.socket(zmq.DEALER)
        # A stable, random routing id lets the engine keep our requests across a reconnect.
        self.dealer.setsockopt(zmq.ROUTING_ID, b"k" + os.urandom(11))
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.setsockopt(zmq.MAXMSGSIZE, P.MAX_REPLY_MESSAGE_BYTES)
        self.dealer.setsockopt(zmq.SNDHWM, 100_000)
        self.dealer.setsockopt(zmq.RCVHWM, 0)  # never drop replies (requests end by themselves)
        self.dealer.connect(endpoint)
        self.sub: zmq.Socket | None = None
        self._pub_endpoint = pub_endpoint
        if subscribe:
            if pub_endpoint is None:
                raise ValueError(
                    "subscribe=True needs pub_endpoint (or call subscribe() after hello())"
                )
            self.subscribe(pub_endpoint)

    # ---------------------------------------------------------------- sending

    def send(self, msg: msgspec.Struct) -> None:
        if self.token is not None and hasattr(msg, "token"):
            msg.token = self.token
        data = P.encode(msg)
        if len(data) > P.MAX_CLIENT_MESSAGE_BYTES:
            raise ValueError(
                f"message of {len(data)} bytes exceeds the engine's limit of "
                f"{P.MAX_CLIENT_MESSAGE_BYTES} bytes"
            )
        try:
            # Never block: a DEALER whose connection was dropped (a reply over
            # MAX_REPLY_MESSAGE_BYTES closes it) has no pipe left to queue into.
            self.dealer.send(data, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            raise EngineError(ERR_ENGINE_GONE, self.send_refused_reason()) from None

    def send_refused_reason(self) -> str:
        return (
            f"cannot send to the engine at {self.endpoint}: the connection is gone or its "
            f"queue is full (a reply over {P.MAX_REPLY_MESSAGE_BYTES >> 20} MiB closes it)"
        )

    def send_hello(self) -> None:
        self.send(P.Hello(protocol_version=P.PROTOCOL_VERSION, client_name=self.client_name))

    def hello(self, timeout: float = 30.0) -> P.Welcome:
        """Blocking handshake. Other messages received meanwhile stay for the next poll()."""
        self.send_hello()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for msg in self._poll_sockets(int(max(0.0, deadline - time.monotonic()) * 1000)):
                if isinstance(msg, P.Welcome):
                    return msg
                if isinstance(msg, P.Error) and msg.request_id is None and msg.control_id is None:
                    raise EngineError(msg.code, msg.message)
                self._pending.append(msg)
        raise EngineError(ERR_ENGINE_GONE, f"no welcome from {self.endpoint} within {timeout} s")

    def submit_generate(
        self,
        request_id: str | None = None,
        *,
        prompt: str | list[int] | None = None,
        messages: Sequence[Any] | None = None,
        sampling: P.SamplingOptions | dict[str, Any] | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Send a generate; returns the request id. Replies arrive through poll()."""
        request_id = request_id or new_request_id()
        opts = make_sampling(sampling)
        msg = P.Generate(
            request_id=request_id,
            prompt=prompt,
            messages=None if messages is None else chat_messages(messages),
            sampling=opts,
            cache_salt=cache_salt,
        )
        self.track_request(request_id, opts.n)
        try:
            self.send(msg)
        except Exception:
            self._active.pop(request_id, None)
            raise
        return request_id

    def submit_abort(self, request_id: str) -> None:
        self.send(P.Abort(request_id=request_id))

    def submit_control(self, op: str, control_id: str = "", **fields: Any) -> str:
        control_id = control_id or new_request_id()
        self.send(P.Control(op=op, control_id=control_id, **fields))  # type: ignore[arg-type]
        return control_id

    def goodbye(self, reason: str = "client closing") -> None:
        try:
            self.send(P.Goodbye(reason=reason))
        except (zmq.ZMQError, EngineError):
            pass

    # ---------------------------------------------------------------- receiving

    def subscribe(self, pub_endpoint: str | None = None) -> None:
        """Open the SUB socket (telemetry, heartbeats) on this connection."""
        endpoint = (
            pub_endpoint or self._pub_endpoint or (self.welcome and self.welcome.pub_endpoint)
        )
        if not endpoint:
            raise ValueError("no pub endpoint known: pass pub_endpoint or call hello() first")
        self.sub = _make_sub(self._ctx, endpoint)

    def sockets(self) -> list[zmq.Socket]:
        return [self.dealer] + ([self.sub] if self.sub is not None else [])

    @property
    def active_requests(self) -> dict[str, int]:
        return dict(self._active)

    def track_request(self, request_id: str, n: int) -> None:
        """Count a request as in flight (heartbeats are sent while any is)."""
        if not self._active:
            # The engine only heartbeats clients with requests: silence before now is normal.
            self.last_engine_message = max(self.last_engine_message, time.monotonic())
        self._active[request_id] = max(1, n)

    def engine_silence(self) -> float:
        """Seconds since the engine last sent anything (meaningful while requests are active)."""
        return time.monotonic() - self.last_engine_message

    def poll(self, timeout_ms: int = 0) -> list[Any]:
        """Everything ready on both sockets, decoded, in arrival order per socket.

        Returns protocol structs: Welcome, Delta, Finish, ControlAck, Error, Heartbeat, Goodbye
        (DEALER) and Telemetry, Heartbeat, Goodbye (SUB). Also sends our heartbeat when due.
        """
        out, self._pending = self._pending, []
        out.extend(self._poll_sockets(0 if out else timeout_ms))
        out.extend(self.maybe_heartbeat())
        return out

    def maybe_heartbeat(self) -> list[P.Error]:
        """Send our heartbeat when due. If it cannot be sent, the connection is gone: every
        request in flight ends with an `engine_unreachable` Error (returned, as poll() would)."""
        now = time.monotonic()
        if not self._active or now - self._last_heartbeat < self.heartbeat_interval:
            return []
        self._last_heartbeat = now
        try:
            self.send(P.Heartbeat(time=now))
        except EngineError as err:
            lost = [P.Error(code=err.code, message=err.message, request_id=r) for r in self._active]
            self._active.clear()
            return lost
        return []

    def _poll_sockets(self, timeout_ms: int) -> list[Any]:
        if timeout_ms == 0:  # the I/O loops already waited: the non-blocking drain finds out
            ready: Any = set(self.sockets())
        else:
            poller = zmq.Poller()
            for s in self.sockets():
                poller.register(s, zmq.POLLIN)
            ready = dict(poller.poll(timeout_ms))
        out: list[Any] = []
        if self.dealer in ready:
            out.extend(self._drain(self.dealer, P.decode_engine, multipart=False))
        if self.sub is not None and self.sub in ready:
            out.extend(self._drain(self.sub, P.decode_pub, multipart=True))
        return out

    def _drain(
        self, sock: zmq.Socket, decode: Any, multipart: bool, limit: int = 10_000
    ) -> list[Any]:
        out: list[Any] = []
        for _ in range(limit):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            self.last_engine_message = time.monotonic()
            try:
                msg = decode(frames[-1])
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("undecodable message from the engine: %s", exc)
                continue
            self._track(msg)
            out.append(msg)
        return out

    def _track(self, msg: Any) -> None:
        if isinstance(msg, P.Welcome):
            self.welcome = msg
            self.heartbeat_interval = msg.heartbeat_interval
        elif isinstance(msg, P.Finish):
            left = self._active.get(msg.request_id)
            if left is not None:
                if left <= 1:
                    del self._active[msg.request_id]
                else:
                    self._active[msg.request_id] = left - 1
        elif isinstance(msg, P.Error) and msg.request_id is not None:
            # An error naming a request ends it, except a refused abort (the request may live on).
            if not msg.code == P.ERR_UNKNOWN_REQUEST:
                self._active.pop(msg.request_id, None)

    def close(self, goodbye: bool = True) -> None:
        if goodbye and not self.dealer.closed:
            self.goodbye()
        for s in self.sockets():
            s.close(linger=100 if goodbye else 0)


def _make_sub(ctx: zmq.Context, endpoint: str, topics: Sequence[bytes] = (b"",)) -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.MAXMSGSIZE, P.MAX_PUB_MESSAGE_BYTES)
    sub.setsockopt(zmq.RCVHWM, 100)  # a slow reader loses old snapshots, not memory
    for t in topics:
        sub.setsockopt(zmq.SUBSCRIBE, t)
    sub.connect(endpoint)
    return sub


# ============================================================== telemetry subscriber


class TelemetrySubscriber:
    """SUB socket for the engine's PUB. Use from one thread (the one that calls recv)."""

    def __init__(
        self,
        pub_endpoint: str,
        *,
        topics: Sequence[bytes] = (P.TOPIC_TELEMETRY, P.TOPIC_HEARTBEAT, P.TOPIC_GOODBYE),
        context: zmq.Context | None = None,
    ) -> None:
        self.endpoint = pub_endpoint
        self.sock = _make_sub(context or zmq.Context.instance(), pub_endpoint, topics)
        self.last_message_time: float | None = None

    def recv(self, timeout: float | None = None) -> Any | None:
        """Next Telemetry / Heartbeat / Goodbye, or None after `timeout` seconds."""
        if timeout is not None and not self.sock.poll(int(timeout * 1000)):
            return None
        while True:
            frames = self.sock.recv_multipart()
            self.last_message_time = time.monotonic()
            try:
                return P.decode_pub(frames[-1])
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("undecodable published message: %s", exc)
                if not self.sock.poll(0 if timeout is not None else -1):
                    return None

    def latest(self, timeout: float | None = None) -> P.Telemetry | None:
        """Wait for a snapshot, then drain the queue and return the newest one."""
        deadline = None if timeout is None else time.monotonic() + timeout
        newest: P.Telemetry | None = None
        while newest is None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            msg = self.recv(left)
            if msg is None:
                return None
            if isinstance(msg, P.Telemetry):
                newest = msg
        while self.sock.poll(0):
            msg = self.recv(0)
            if isinstance(msg, P.Telemetry):
                newest = msg
        return newest

    def __iter__(self) -> Iterator[Any]:
        while True:
            msg = self.recv()
            if msg is not None:
                yield msg

    def close(self) -> None:
        self.sock.close(linger=0)

    def __enter__(self) -> TelemetrySubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
