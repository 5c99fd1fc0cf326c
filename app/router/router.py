"""The disaggregation router: one prefill engine, one decode engine, one client-facing API.

It stands where the HTTP front-end expects an AsyncEngineClient (generate, tokenize, control,
telemetry, ...). A request goes to the prefill engine with one output token; its first token is
streamed to the caller at once, and the request is handed to the decode engine with the lease of
its prompt blocks (docs/PROTOCOL.md section 10). Requests with n > 1 go to the decode engine
whole. When one engine is gone the other serves whole requests alone (degraded, and `status()`
says which one is missing); requests in flight on the lost engine end with an error naming it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import time
from collections.abc import Callable
from typing import Any

import msgspec

from ipc import protocol as P
from ipc.async_client import AsyncEngineClient, AsyncRequestStream
from ipc.client import ERR_ENGINE_GONE, EngineError

log = logging.getLogger(__name__)

ERR_INSTANCE_MISMATCH = "instance_mismatch"
# What two engines must agree on before one may decode on the other's KV blocks.
MATCHING_FIELDS = ("model_id", "dtype", "block_size", "kv_cache_dtype", "cache_identity")

ClientOf = Callable[[], AsyncEngineClient | None]  # the engine's client while it is ready


def mismatch(prefill: P.ModelInfo, decode: P.ModelInfo) -> str | None:
    """Why these two engines cannot be paired (None: they can)."""
    if prefill.role != "prefill" or decode.role != "decode":
        return (f"expected a prefill and a decode engine, got roles {prefill.role!r} and "
                f"{decode.role!r} (start them with --role)")  # fmt: skip
    for name in MATCHING_FIELDS:
        a, b = getattr(prefill, name), getattr(decode, name)
        if a != b:
            return f"the engines differ in {name}: prefill {a!r}, decode {b!r}"
    return None


def split_threads(cores: int | None = None) -> tuple[int, int]:
    """Torch threads of the prefill and the decode engine: the cores split in two halves (the
    prefill half gets the odd core: prompts are compute-bound, decode steps mostly wait on
    memory)."""
    if cores is None:
        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cores = os.cpu_count() or 2
    cores = max(2, cores)
    return cores - cores // 2, cores // 2


class RoutedStream(AsyncRequestStream):
    """One request's Delta and Finish messages, whichever engine produced them."""

    def __init__(self, router: DisaggRouter, request_id: str, n: int) -> None:
        super().__init__(router, request_id, n)  # type: ignore[arg-type]
        self.aborted = False
        self.stage: AsyncRequestStream | None = None  # the engine request running now
        self.task: asyncio.Task[None] | None = None
        self.transfer_seconds: float | None = None  # handoff -> first decode-side message

    async def abort(self) -> None:
        self.aborted = True
        if self.stage is not None and not self.stage.done:
            with contextlib.suppress(EngineError):
                await self.stage.abort()


class DisaggRouter:
    def __init__(self, prefill: ClientOf, decode: ClientOf, names: tuple[str, str]) -> None:
        self._prefill = prefill
        self._decode = decode
        self.names = names  # how errors name the two engines (e.g. their endpoints)
        self.streams: dict[str, RoutedStream] = {}
        self.handoffs = 0
        self.whole = 0  # requests served by one engine alone (n > 1, or degraded)

    # ------------------------------------------------------------ the AsyncEngineClient face

    def _either(self) -> AsyncEngineClient:
        client = self._decode() or self._prefill()
        if client is None:
            raise EngineError(ERR_ENGINE_GONE, "neither the prefill nor the decode engine is up")
        return client

    @property
    def state(self) -> str:
        return "ready" if (self._decode() or self._prefill()) else "gone"

    @property
    def gone_reason(self) -> str | None:
        return None if self.state == "ready" else "both engines of the deployment are gone"

    @property
    def model_info(self) -> P.ModelInfo:
        return self._either().model_info

    @property
    def welcome(self) -> P.Welcome | None:
        return self._either().welcome

    @property
    def telemetry(self) -> P.Telemetry | None:
        client = self._decode() or self._prefill()
        return None if client is None else client.telemetry

    def tap_telemetry(self, maxsize: int = 16) -> asyncio.Queue[bytes]:
        return self._either().tap_telemetry(maxsize)

    def untap_telemetry(self, tap: asyncio.Queue[bytes]) -> None:
        for client in (self._decode(), self._prefill()):
            if client is not None:
                client.untap_telemetry(tap)

    @property
    def num_in_flight(self) -> int:
        return len(self.streams)

    def _forget(self, request_id: str) -> None:
        self.streams.pop(request_id, None)

    def status(self) -> dict[str, str]:
        return {
            "prefill": "ready" if self._prefill() else "gone",
            "decode": "ready" if self._decode() else "gone",
        }

    async def tokenize(self, **kwargs: Any) -> P.Tokenized:
        return await self._either().tokenize(**kwargs)

    async def detokenize(self, token_ids: list[int], timeout: float = 30.0) -> P.Tokenized:
        return await self._either().detokenize(token_ids, timeout)

    async def control(self, op: str, timeout: float = 30.0, **fields: Any) -> P.ControlAck:
        """Applied to both engines; the decode engine's acknowledgement is returned."""
        acks = [await c.control(op, timeout, **fields)
                for c in (self._prefill(), self._decode()) if c is not None]  # fmt: skip
        if not acks:
            raise EngineError(ERR_ENGINE_GONE, "neither engine is up")
        return acks[-1]

    async def close(self) -> None:
        for stream in list(self.streams.values()):
            if stream.task is not None:
                stream.task.cancel()

    # ------------------------------------------------------------ requests

    async def generate(
        self,
        request_id: str,
        *,
        prompt: str | list[int] | None = None,
        messages: list[P.ChatMessage] | None = None,
        sampling: P.SamplingOptions | None = None,
        cache_salt: str | None = None,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> RoutedStream:
        sampling = sampling or P.SamplingOptions()
        if request_id in self.streams:
            raise ValueError(f"request_id {request_id!r} is already in flight on this router")
        if self._decode() is None and self._prefill() is None:
            raise EngineError(ERR_ENGINE_GONE, "neither the prefill nor the decode engine is up")
        stream = RoutedStream(self, request_id, sampling.n)
        self.streams[request_id] = stream
        # both halves render the same prompt (tools and template arguments included), so the
        # decode engine's prefix hashes match the blocks it pulls
        request = dict(prompt=prompt, messages=messages, cache_salt=cache_salt, tools=tools,
                       chat_template_kwargs=chat_template_kwargs)  # fmt: skip
        stream.task = asyncio.create_task(self._run(stream, request, sampling))
        return stream

    async def _run(self, stream: RoutedStream, request: dict, sampling: P.SamplingOptions) -> None:
        try:
            prefill, decode = self._prefill(), self._decode()
            if sampling.n != 1 or prefill is None or decode is None:
                self.whole += 1
                client = decode or prefill
                assert client is not None
                await self._relay(stream, client, request, sampling, None, self._name(client))
                return
            await self._disaggregated(stream, prefill, decode, request, sampling)
        except EngineError as exc:
            stream.queue.put_nowait(exc)
        except asyncio.CancelledError:
            stream.queue.put_nowait(EngineError("client_closed", "the router is closing"))
            raise
        except Exception as exc:  # a router bug must still end the caller's stream
            log.exception("routing %s failed", stream.request_id)
            stream.queue.put_nowait(EngineError(P.ERR_INTERNAL, f"router error: {exc}"))
        finally:
            self.streams.pop(stream.request_id, None)

    def _name(self, client: AsyncEngineClient) -> str:
        return "prefill" if client is self._prefill() else "decode"

    async def _disaggregated(
        self, stream: RoutedStream, prefill: AsyncEngineClient, decode: AsyncEngineClient,
        request: dict, sampling: P.SamplingOptions,
    ) -> None:  # fmt: skip
        t0 = time.monotonic()
        # One seed for both halves: the decode engine's draws continue the prefill engine's.
        seed = sampling.seed if sampling.seed is not None else random.getrandbits(63)
        sampling = msgspec.structs.replace(sampling, seed=seed)
        first = msgspec.structs.replace(sampling, max_tokens=1)
        finish, tokens = await self._relay(
            stream, prefill, request, first, P.KVTransferParams(do_remote_decode=True),
            "prefill", hold_finish=True,
        )  # fmt: skip
        assert finish is not None
        handoff = finish.kv_handoff
        if finish.reason != "length" or sampling.max_tokens <= 1 or handoff is None:
            stream.queue.put_nowait(finish)
            return
        if stream.aborted:
            stream.queue.put_nowait(msgspec.structs.replace(finish, reason="abort",
                                                            error="aborted by the client"))
            return
        self.handoffs += 1
        ttft = time.monotonic() - t0
        kv = P.KVTransferParams(remote_endpoint=handoff.endpoint, remote_lease_id=handoff.lease_id,
                                block_hashes=handoff.block_hashes, output_token_ids=tokens)
        handed = time.monotonic()
        last, _ = await self._relay(stream, decode, request, sampling, kv, "decode",
                                    hold_finish=True, on_first=lambda: _mark(stream, handed))
        assert last is not None
        stream.queue.put_nowait(msgspec.structs.replace(
            last, ttft=ttft, usage=msgspec.structs.replace(
                last.usage, cached_tokens=finish.usage.cached_tokens)))  # fmt: skip

    async def _relay(
        self, stream: RoutedStream, client: AsyncEngineClient, request: dict,
        sampling: P.SamplingOptions, kv: P.KVTransferParams | None, name: str,
        hold_finish: bool = False, on_first: Callable[[], None] | None = None,
    ) -> tuple[P.Finish | None, list[int]]:  # fmt: skip
        """Forward one engine request's messages; with hold_finish its (single) Finish is
        returned instead of forwarded."""
        try:
            stage = await client.generate(stream.request_id, sampling=sampling,
                                          kv_transfer=kv, **request)  # fmt: skip
        except EngineError as exc:
            raise EngineError(exc.code, f"{name} engine: {exc.message}") from None
        stream.stage = stage
        if stream.aborted:
            await stream.abort()
        tokens: list[int] = []
        finish: P.Finish | None = None
        try:
            async for msg in stage:
                if on_first is not None:
                    on_first()
                    on_first = None
                if isinstance(msg, P.Delta):
                    tokens += msg.token_ids
                    stream.queue.put_nowait(msg)
                elif hold_finish:
                    finish = msg
                else:
                    stream.queue.put_nowait(msg)
        except EngineError as exc:
            raise EngineError(exc.code, f"{name} engine: {exc.message}") from None
        assert finish is not None or not hold_finish
        return finish, tokens


def _mark(stream: RoutedStream, handed: float) -> None:
    stream.transfer_seconds = time.monotonic() - handed
