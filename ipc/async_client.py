"""An asyncio client of the engine (plain Python and pyzmq; no torch, Qt or engine_proc).

For front-ends that serve many concurrent callers from one event loop, such as the HTTP API:
one DEALER and one SUB on the loop, a reader task that routes replies to per-request queues, a
heartbeat task, and the newest telemetry snapshot kept for whoever asks (metrics, health).

    client = AsyncEngineClient(endpoint, client_name="http")
    await client.connect()                         # hello -> welcome, starts the tasks
    stream = await client.generate("r1", prompt="Hi", sampling=P.SamplingOptions(max_tokens=8))
    async for event in stream:                     # Delta ... Finish (one Finish per sequence)
        ...
    await client.close()

The engine counts as gone when neither socket has carried anything for `3 x heartbeat_interval`
(it heartbeats on PUB every interval) or it said goodbye: every open stream then ends with an
EngineError of code ERR_ENGINE_GONE and `state` becomes "gone".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from ipc import protocol as P
from ipc.client import ERR_ENGINE_GONE, EngineError

log = logging.getLogger(__name__)

_GONE_AFTER_HEARTBEATS = 3


class AsyncRequestStream:
    """The replies of one generate request: iterate for Delta and Finish messages.

    Raises EngineError when the engine refused the request or went away. Leaving the iteration
    early (or cancelling the task that iterates) does not abort the request: call `abort()`."""

    def __init__(self, client: AsyncEngineClient, request_id: str, n: int) -> None:
        self.client = client
        self.request_id = request_id
        self.n = n
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.finished: set[int] = set()
        self.failed = False  # refused by the engine, or the engine went away

    @property
    def done(self) -> bool:
        return self.failed or len(self.finished) >= self.n

    def __aiter__(self) -> AsyncIterator[P.Delta | P.Finish]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[P.Delta | P.Finish]:
        while not self.done:
            msg = await self.queue.get()
            if isinstance(msg, EngineError):
                self.failed = True
                self.client._forget(self.request_id)
                raise msg
            if isinstance(msg, P.Finish):
                self.finished.add(msg.index)
                if self.done:
                    self.client._forget(self.request_id)
            yield msg

    async def abort(self) -> None:
        """Ask the engine to end the request (its blocks are freed within one step)."""
        if not self.done and self.client.state == "ready":
            await self.client.abort(self.request_id)
        self.client._forget(self.request_id)


class AsyncEngineClient:
    def __init__(
        self,
        endpoint: str,
        *,
        token: str | None = None,
        client_name: str = "",
        subscribe: bool = True,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.token = token
        self.client_name = client_name
        self.subscribe = subscribe
        self.state = "connecting"  # connecting | ready | gone | closed
        self.gone_reason = ""
        self.welcome: P.Welcome | None = None
        self._telemetry_raw: bytes | None = None  # the newest snapshot, decoded on demand
        self._telemetry: P.Telemetry | None = None
        self.last_engine_message = time.monotonic()
        self._ctx = context or zmq.asyncio.Context.instance()
        self._streams: dict[str, AsyncRequestStream] = {}
        self._replies: dict[str, asyncio.Future[Any]] = {}  # tokenize / control replies
        self._tasks: list[asyncio.Task[None]] = []
        self._welcome: asyncio.Future[P.Welcome] | None = None
        self._telemetry_taps: set[asyncio.Queue[bytes]] = set()
        self.dealer = self._ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.ROUTING_ID, b"a" + os.urandom(11))
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.setsockopt(zmq.MAXMSGSIZE, P.MAX_REPLY_MESSAGE_BYTES)
        self.dealer.setsockopt(zmq.SNDHWM, 100_000)
        self.dealer.setsockopt(zmq.RCVHWM, 0)  # never drop replies
        self.dealer.connect(endpoint)
        self.sub: zmq.asyncio.Socket | None = None

    # ------------------------------------------------------------ lifecycle

    async def connect(self, timeout: float = 30.0) -> P.Welcome:
        """Say hello and start the reader, heartbeat and telemetry tasks."""
        loop = asyncio.get_running_loop()
        self._welcome = loop.create_future()
        self._tasks.append(asyncio.create_task(self._read_dealer(), name="engine-dealer"))
        await self._send(P.Hello(protocol_version=P.PROTOCOL_VERSION, client_name=self.client_name))
        try:
            welcome = await asyncio.wait_for(self._welcome, timeout)
        except TimeoutError:
            await self.close()
            msg = f"no welcome from {self.endpoint} in {timeout} s"
            raise EngineError(ERR_ENGINE_GONE, msg) from None
        except EngineError:
            await self.close()
            raise
        self.welcome = welcome
        self.last_engine_message = time.monotonic()
        if self.subscribe:
            self.sub = self._ctx.socket(zmq.SUB)
            self.sub.setsockopt(zmq.LINGER, 0)
            self.sub.setsockopt(zmq.MAXMSGSIZE, P.MAX_PUB_MESSAGE_BYTES)
            self.sub.setsockopt(zmq.RCVHWM, 64)
            self.sub.setsockopt(zmq.SUBSCRIBE, b"")
            self.sub.connect(welcome.pub_endpoint)
            self._tasks.append(asyncio.create_task(self._read_sub(), name="engine-sub"))
        self._tasks.append(asyncio.create_task(self._keepalive(), name="engine-keepalive"))
        self.state = "ready"
        return welcome

    async def close(self) -> None:
        if self.state == "closed":
            return
        if self.state == "ready":
            with contextlib.suppress(zmq.ZMQError, EngineError):
                await self._send(P.Goodbye(reason="client closing"))
        self._mark_gone("client closed", state="closed")
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self.dealer.close(linger=100)
        if self.sub is not None:
            self.sub.close(linger=0)

    @property
    def model_info(self) -> P.ModelInfo:
        assert self.welcome is not None, "connect() first"
        return self.welcome.model

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # ------------------------------------------------------------ requests

    async def generate(
        self,
        request_id: str,
        *,
        prompt: str | list[int] | None = None,
        messages: list[P.ChatMessage] | None = None,
        sampling: P.SamplingOptions | None = None,
        cache_salt: str | None = None,
        kv_transfer: P.KVTransferParams | None = None,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> AsyncRequestStream:
        self._check_ready()
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in flight on this client")
        sampling = sampling or P.SamplingOptions()
        msg = P.Generate(
            request_id=request_id,
            prompt=prompt,
            messages=messages,
            sampling=sampling,
            cache_salt=cache_salt,
            kv_transfer=kv_transfer,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
        )
        stream = AsyncRequestStream(self, request_id, sampling.n)
        self._streams[request_id] = stream
        try:
            await self._send(msg)
        except EngineError:
            self._streams.pop(request_id, None)
            raise
        return stream

    async def abort(self, request_id: str) -> None:
        if self.state == "ready":
            await self._send(P.Abort(request_id=request_id))

    async def tokenize(
        self,
        *,
        prompt: str | None = None,
        messages: list[P.ChatMessage] | None = None,
        add_special_tokens: bool = True,
        add_generation_prompt: bool = True,
        timeout: float = 30.0,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> P.Tokenized:
        msg = P.Tokenize(
            request_id=f"tok-{os.urandom(8).hex()}",
            prompt=prompt,
            messages=messages,
            add_special_tokens=add_special_tokens,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
        )
        return await self._ask(msg, msg.request_id, timeout)

    async def detokenize(self, token_ids: list[int], timeout: float = 30.0) -> P.Tokenized:
        msg = P.Detokenize(request_id=f"detok-{os.urandom(8).hex()}", token_ids=token_ids)
        return await self._ask(msg, msg.request_id, timeout)

    async def control(self, op: str, timeout: float = 30.0, **fields: Any) -> P.ControlAck:
        control_id = f"ctl-{os.urandom(8).hex()}"
        msg = P.Control(op=op, control_id=control_id, **fields)
        return await self._ask(msg, control_id, timeout)

    async def _ask(self, msg: msgspec.Struct, key: str, timeout: float) -> Any:
        self._check_ready()
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._replies[key] = future
        try:
            await self._send(msg)
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise EngineError(ERR_ENGINE_GONE, f"no reply from the engine in {timeout} s") from None
        finally:
            self._replies.pop(key, None)

    # ------------------------------------------------------------ internals

    def _check_ready(self) -> None:
        if self.state != "ready":
            raise EngineError(ERR_ENGINE_GONE, self.gone_reason or f"engine {self.state}")

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    async def _send(self, msg: msgspec.Struct) -> None:
        if self.token is not None and hasattr(msg, "token"):
            msg.token = self.token  # type: ignore[attr-defined]
        try:
            # Never wait: a DEALER whose connection was dropped (a reply over
            # MAX_REPLY_MESSAGE_BYTES closes it) would hold the send forever.
            await self.dealer.send(P.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            why = (
                f"cannot send to the engine at {self.endpoint}: the connection is gone or its "
                f"queue is full (a reply over {P.MAX_REPLY_MESSAGE_BYTES >> 20} MiB closes it)"
            )
            self._mark_gone(why)
            raise EngineError(ERR_ENGINE_GONE, why) from None

    async def _read_dealer(self) -> None:
        while True:
            data = await self.dealer.recv()
            self.last_engine_message = time.monotonic()
            try:
                msg = P.decode_engine(data)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("undecodable message from the engine: %s", exc)
                continue
            self._route(msg)

    def _route(self, msg: Any) -> None:
        if isinstance(msg, P.Delta | P.Finish):
            stream = self._streams.get(msg.request_id)
            if stream is not None:
                stream.queue.put_nowait(msg)
        elif isinstance(msg, P.Tokenized | P.ControlAck):
            key = msg.request_id if isinstance(msg, P.Tokenized) else msg.control_id
            future = self._replies.get(key)
            if future is not None and not future.done():
                future.set_result(msg)
        elif isinstance(msg, P.Error):
            self._route_error(msg)
        elif isinstance(msg, P.Welcome):
            if self._welcome is not None and not self._welcome.done():
                self._welcome.set_result(msg)
        elif isinstance(msg, P.Goodbye):
            self._mark_gone(f"engine shutting down: {msg.reason}")

    def _route_error(self, msg: P.Error) -> None:
        err = EngineError(msg.code, msg.message, msg.request_id)
        for key in (msg.request_id, msg.control_id):
            if key is None:
                continue
            if key in self._streams:
                self._streams[key].queue.put_nowait(err)
                return
            future = self._replies.get(key)
            if future is not None and not future.done():
                future.set_exception(err)
                return
        if self._welcome is not None and not self._welcome.done():
            self._welcome.set_exception(err)  # version_mismatch, unauthorized
            return
        log.warning("engine error: [%s] %s", msg.code, msg.message)

    async def _read_sub(self) -> None:
        assert self.sub is not None
        while True:
            frames = await self.sub.recv_multipart()
            self.last_engine_message = time.monotonic()
            if len(frames) != 2:
                continue
            if frames[0] == P.TOPIC_TELEMETRY:
                # Decoded only when someone reads it (a /metrics scrape): at 20 Hz the block
                # arrays would cost the front-end CPU the engine could use.
                self._telemetry_raw, self._telemetry = frames[1], None
                self._feed_taps(frames[1])
            elif frames[0] == P.TOPIC_GOODBYE:
                self._mark_gone("engine shutting down")

    @property
    def telemetry(self) -> P.Telemetry | None:
        """The newest telemetry snapshot (None before the first, or if it does not decode)."""
        if self._telemetry is None and self._telemetry_raw is not None:
            try:
                msg = P.decode_pub(self._telemetry_raw)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("undecodable telemetry: %s", exc)
                self._telemetry_raw = None
                return None
            self._telemetry = msg if isinstance(msg, P.Telemetry) else None
        return self._telemetry

    def tap_telemetry(self, maxsize: int = 16) -> asyncio.Queue[bytes]:
        """A queue of every telemetry snapshot from now on, as the engine encoded it. A reader
        that falls behind loses the oldest (like a PUB subscriber); `untap_telemetry` ends it."""
        tap: asyncio.Queue[bytes] = asyncio.Queue(maxsize)
        self._telemetry_taps.add(tap)
        return tap

    def untap_telemetry(self, tap: asyncio.Queue[bytes]) -> None:
        self._telemetry_taps.discard(tap)

    def _feed_taps(self, raw: bytes) -> None:
        for tap in self._telemetry_taps:
            if tap.full():
                tap.get_nowait()
            tap.put_nowait(raw)

    async def _keepalive(self) -> None:
        assert self.welcome is not None
        interval = self.welcome.heartbeat_interval
        while self.state == "ready":
            await asyncio.sleep(interval)
            silence = time.monotonic() - self.last_engine_message
            if self.subscribe and silence > _GONE_AFTER_HEARTBEATS * interval:
                self._mark_gone(f"no word from the engine for {silence:.1f} s")
                return
            with contextlib.suppress(zmq.ZMQError, EngineError):
                await self._send(P.Heartbeat(time=time.monotonic()))

    def lost(self, why: str) -> None:
        """The engine is known to be gone (its supervisor saw the process exit): every request
        in flight ends now with ERR_ENGINE_GONE instead of after the heartbeat silence."""
        self._mark_gone(why)

    def _mark_gone(self, why: str, state: str = "gone") -> None:
        if self.state in ("gone", "closed"):
            self.state = "closed" if state == "closed" else self.state
            return
        if state == "gone":
            log.warning("engine connection lost: %s", why)
        self.state = state
        self.gone_reason = why
        err = EngineError(ERR_ENGINE_GONE, why)
        for stream in list(self._streams.values()):
            stream.queue.put_nowait(err)
        for future in self._replies.values():
            if not future.done():
                future.set_exception(err)
