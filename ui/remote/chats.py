"""RemoteLink's chats and load generator over HTTP (mixed into ui/remote/link.py's RemoteLink,
whose worker thread runs them): each a task streaming `/v1/chat/completions`; Stop cancels the
task, which closes the stream, which makes the server abort the request. Replies become
ipc.protocol Delta / Finish / Error, as from the engine."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx

from app.load_generator import LoadConfig, LoadGenerator
from app.remote.kvscope_http import RemoteError
from app.remote.metrics import KINDS
from app.remote.openai_client import ChatDelta, ReplyStats, astream_chat
from app.remote.probe import ServerInfo
from ipc import protocol as P
from ipc.client import ERR_ENGINE_GONE

log = logging.getLogger("ui.remote.link")

ERR_SERVER = "server_error"  # the server answered a chat with a 5xx status


class ChatStreams:
    """The chat and load-generator half of RemoteLink (its attributes, set by RemoteLink)."""

    url: str
    api_key: str | None
    info: ServerInfo | None
    _chats: dict[str, asyncio.Task]
    _aborting: set[str]
    _loads: dict[str, asyncio.Task]
    _gen: LoadGenerator
    _replies: list[Any]
    _chat_http: httpx.AsyncClient | None
    alias: Any  # RemoteLink's signals
    load_stats: Any

    # --- chats -----------------------------------------------------------------------------
    def _body(self, messages: list[dict], sampling: dict) -> dict:
        info = self.info
        body: dict[str, Any] = {"messages": messages}
        if info is not None and info.model:
            body["model"] = info.model
        for name in ("temperature", "top_p", "max_tokens", "seed"):
            if sampling.get(name) is not None:
                body[name] = sampling[name]
        known = info is not None and info.kind in KINDS  # servers with vLLM's extensions
        if known and sampling.get("top_k"):
            body["top_k"] = int(sampling["top_k"])
        if known and sampling.get("ignore_eos"):
            body["ignore_eos"] = True
        return body

    def _start_chat(self, rid: str, messages: list[dict], sampling: dict) -> None:
        if self.info is None:
            self._replies.append(P.Error(code=ERR_ENGINE_GONE, request_id=rid,
                                         message=f"not connected to {self.url}"))
            return
        self._chats[rid] = asyncio.get_running_loop().create_task(
            self._chat(rid, self._body(messages, sampling)))

    def _abort_chat(self, rid: str) -> None:
        task = self._chats.get(rid)
        if task is not None and not task.done():
            self._aborting.add(rid)
            task.cancel()

    async def _chat(self, rid: str, body: dict) -> None:
        assert self._chat_http is not None
        stats = ReplyStats(start=time.monotonic())
        named = False
        try:
            async for ev in astream_chat(self._chat_http, self.url, self.api_key, body, stats):
                if not named and stats.response_id:
                    named = True
                    self.alias.emit(rid, stats.response_id)
                if isinstance(ev, ChatDelta) and ev.index == 0:
                    self._replies.append(P.Delta(request_id=rid, index=0, token_ids=[],
                                                 text=ev.text, token_times=[ev.time],
                                                 time=ev.time))
            self._replies.append(_finish(rid, stats, stats.finish_reason or "stop"))
        except asyncio.CancelledError:
            if rid not in self._aborting:
                raise  # the link is closing
            stats.end = stats.end or time.monotonic()
            self._replies.append(_finish(rid, stats, "abort"))
        except RemoteError as exc:
            self._replies.append(P.Error(code=_error_code(exc), message=str(exc),
                                         request_id=rid))
        finally:
            self._chats.pop(rid, None)
            self._aborting.discard(rid)

    # --- load generator ------------------------------------------------------------------------
    def _load_start(self, config: LoadConfig) -> None:
        self._gen.start(config)
        self._load_fill()

    def _load_stop(self) -> None:
        for rid in self._gen.stop():
            task = self._loads.get(rid)
            if task is not None:
                task.cancel()
        self.load_stats.emit(self._gen.stats.as_dict() | {"running": False})

    def _load_fill(self) -> None:
        if self.info is None:
            return
        loop = asyncio.get_running_loop()
        for req in self._gen.next_requests():
            body = self._body(req.messages, req.sampling)
            self._loads[req.request_id] = loop.create_task(self._load_one(req.request_id, body))

    async def _load_one(self, rid: str, body: dict) -> None:
        assert self._chat_http is not None
        stats = ReplyStats(start=time.monotonic())
        error = False
        try:
            async for ev in astream_chat(self._chat_http, self.url, self.api_key, body, stats):
                if isinstance(ev, ChatDelta):
                    self._gen.on_delta(rid, 1)  # about a token per chunk: usage corrects it
        except asyncio.CancelledError:
            if self._gen.running:
                raise  # the link is closing
            # stopped: counted as finished, like an aborted engine request
        except RemoteError as exc:
            error = True
            log.info("load request %s failed: %s", rid, exc)
        finally:
            self._loads.pop(rid, None)
            u = stats.usage
            if u is not None and u.completion_tokens > stats.num_chunks:
                self._gen.on_delta(rid, u.completion_tokens - stats.num_chunks)
            self._gen.on_finish(rid, u.prompt_tokens if u else 0,
                                (u.cached_tokens or 0) if u else 0, error=error)
        if self._gen.running:
            if error:  # do not hammer a server that refuses: try again in a second
                asyncio.get_running_loop().call_later(1.0, self._load_fill)
            else:
                self._load_fill()


def _finish(rid: str, stats: ReplyStats, reason: str) -> P.Finish:
    u = stats.usage
    usage = None if u is None else P.Usage(prompt_tokens=u.prompt_tokens,
                                           cached_tokens=u.cached_tokens,  # None: not reported
                                           completion_tokens=u.completion_tokens)
    tps = stats.tokens_per_second
    end = stats.end or time.monotonic()
    return P.Finish(request_id=rid, index=0, reason=reason, usage=usage,  # type: ignore[arg-type]
                    ttft=stats.ttft, tpot=1.0 / tps if tps else None, e2e=end - stats.start)


def _error_code(exc: RemoteError) -> str:
    if exc.status is None:
        return ERR_ENGINE_GONE  # cut, unreachable, malformed: the reply was interrupted
    return ERR_SERVER if exc.status >= 500 else P.ERR_INVALID_REQUEST
