"""The window's door to a server over HTTP: vLLM, SGLang, llama.cpp's server, or a KVScope
front-end (`kvscope serve`) — `python -m app --connect http://HOST:PORT`.

`RemoteLink` has the signals the window already takes from ui/engine_link.py where they apply
(connected, connect_failed, replies, frames, load_stats, stalled, recovered), plus `metrics`
for servers without per-block telemetry. All HTTP runs on one worker thread with an asyncio
loop: chats and the load generator stream `/v1/chat/completions` (one task each; Stop cancels
the task, which closes the stream, which makes the server abort the request), and one watcher
task either follows a KVScope server's telemetry stream (`/kvscope/telemetry`: the same Frames as
the ZeroMQ link) or scrapes `/metrics` about twice a second into `MetricSample`s. A slow or dead
server only delays that thread; the GUI thread never waits on a socket. After a failure the
watcher keeps retrying, and a server that comes back (restarted) is discovered again.

Replies reach the chat panel as ipc.protocol Delta / Finish / Error, as from the engine; what
a stream cannot tell stays unknown: Delta.token_ids is empty, Finish.usage is None when the
server sent no usage, Usage.cached_tokens is None when it does not report cached tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
from PySide6.QtCore import QObject, Signal

from app.load_generator import LoadConfig, LoadGenerator
from app.remote.kvscope_http import RemoteError, afetch_welcome, astream_telemetry
from app.remote.metrics import KINDS, MetricsError
from app.remote.openai_client import ChatDelta, ReplyStats, astream_chat, describe
from app.remote.probe import (
    ServerInfo,
    discover,
    fetch_metrics_text,
    normalize_url,
    parse_scrape,
)
from app.remote.samples import ScrapeWindow
from ipc import protocol as P
from ipc.client import ERR_ENGINE_GONE
from ui.telemetry import Frame

log = logging.getLogger(__name__)

ERR_SERVER = "server_error"  # the server answered a chat with a 5xx status


class RemoteLink(QObject):
    connected = Signal(object)  # app.remote.probe.ServerInfo; again when it changes
    connect_failed = Signal(str)
    replies = Signal(list)  # Delta / Finish / Error of the window's chats
    frames = Signal(list)  # list[Frame] (KVScope servers only)
    metrics = Signal(object)  # app.remote.samples.MetricSample (servers without telemetry)
    metrics_problem = Signal(str)  # why /metrics could not be read; "" once it reads again
    alias = Signal(str, str)  # a chat's request id, the id the server gave its response
    control_reply = Signal(object)  # engine controls need the ZeroMQ protocol: always an Error
    load_stats = Signal(dict)
    stalled = Signal(str)  # the server stopped answering
    recovered = Signal()  # it answers again
    goodbye = Signal(str)  # (never: HTTP servers do not say goodbye; kept for the window)
    finished = Signal()

    def __init__(self, url: str, *, api_key: str | None = None, scrape_interval: float = 0.5,
                 scrape_timeout: float = 10.0, connect_timeout: float = 10.0,
                 stall_timeout: float = 10.0, retry_interval: float = 1.0,
                 window_s: float = 10.0, chat_read_timeout: float = 300.0,
                 clock: Callable[[], float] = time.monotonic,
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.url = normalize_url(url)
        self.api_key = api_key or None
        self.scrape_interval = scrape_interval
        self.scrape_timeout = scrape_timeout
        self.connect_timeout = connect_timeout
        self.stall_timeout = stall_timeout
        self.retry_interval = retry_interval
        self.chat_read_timeout = chat_read_timeout
        self.clock = clock  # timestamps of scrapes (tests pass a scripted one)
        self.info: ServerInfo | None = None
        self.welcome: P.Welcome | None = None
        self._window = ScrapeWindow(window_s)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._main_task: asyncio.Task | None = None
        self._thread: threading.Thread | None = None
        self._ids = 0
        # worker-thread state
        self._chats: dict[str, asyncio.Task] = {}
        self._aborting: set[str] = set()
        self._loads: dict[str, asyncio.Task] = {}
        self._gen = LoadGenerator()
        self._replies: list[Any] = []
        self._frames: list[Frame] = []
        self._stalled = False
        self._problem = ""
        self._last_frame = 0.0
        self._last_stats = 0.0
        self._chat_http: httpx.AsyncClient | None = None
        self._watch_http: httpx.AsyncClient | None = None

    # --- GUI-thread API --------------------------------------------------------------------
    def start(self) -> None:
        assert self._thread is None
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._main_task = loop.create_task(self._main())  # runs once the thread starts
        self._thread = threading.Thread(target=self._run, name="kvscope-remote-link",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 3.0) -> None:
        if self._thread is None:
            return
        task = self._main_task
        if task is not None:
            self._call(task.cancel)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("remote link worker did not stop within %.1f s", timeout)
        self._thread = None

    def generate(self, request_id: str, messages: list[dict], sampling: dict) -> None:
        self._call(self._start_chat, request_id, messages, sampling)

    def abort(self, request_id: str) -> None:
        self._call(self._abort_chat, request_id)

    def control(self, op: str, **fields: Any) -> str:
        self._ids += 1
        control_id = f"gui-{self._ids}"
        self.control_reply.emit(P.Error(
            code=P.ERR_INVALID_CONTROL, control_id=control_id,
            message=f"{op} needs the engine protocol (attach with --connect tcp://...); this "
                    "window watches the server over HTTP"))
        return control_id

    def start_load(self, config: LoadConfig) -> None:
        self._call(self._load_start, config)

    def stop_load(self) -> None:
        self._call(self._load_stop)

    def _call(self, fn: Callable, *args: Any) -> None:
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the worker has ended (connect failed, or stopped)
            pass

    # --- worker thread ---------------------------------------------------------------------
    def _run(self) -> None:
        loop, task = self._loop, self._main_task
        assert loop is not None and task is not None
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(task)
        except asyncio.CancelledError:
            pass
        except Exception as exc:  # the worker must never die silently
            log.exception("remote link worker failed")
            self.stalled.emit(f"remote link failed: {exc}")
        finally:
            try:
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                loop.close()
            self.finished.emit()

    async def _main(self) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        chat_timeout = httpx.Timeout(self.connect_timeout, read=self.chat_read_timeout)
        async with httpx.AsyncClient(timeout=chat_timeout, limits=limits) as chat_http, \
                httpx.AsyncClient(timeout=self.scrape_timeout) as watch_http:
            self._chat_http, self._watch_http = chat_http, watch_http
            flusher = asyncio.create_task(self._flush_loop())
            watcher: asyncio.Task | None = None
            try:
                try:
                    info = await asyncio.wait_for(
                        self._discover(), self.connect_timeout + self.scrape_timeout + 5.0)
                except (RemoteError, ValueError) as exc:
                    self.connect_failed.emit(str(exc))
                    return
                except TimeoutError:
                    self.connect_failed.emit(f"{self.url} did not answer within "
                                             f"{self.connect_timeout:.0f} s")
                    return
                except Exception as exc:  # a bug, or an error httpx does not wrap: say it
                    log.exception("discovering %s failed", self.url)
                    self.connect_failed.emit(f"unexpected error: {exc!r}")
                    return
                self._take_info(info, fresh=True)
                watcher = asyncio.create_task(
                    self._watch_telemetry() if info.per_block else self._watch_metrics())
                watcher.add_done_callback(self._watcher_done)
                await asyncio.Event().wait()  # until cancelled by stop()
            finally:
                tasks = [flusher, *([watcher] if watcher else []), *self._chats.values(),
                         *self._loads.values()]
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    def _watcher_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            log.error("remote link watcher failed", exc_info=exc)
            self.stalled.emit(f"the link stopped watching the server: {exc!r}")

    async def _discover(self) -> ServerInfo:
        assert self._watch_http is not None
        return await discover(self._watch_http, self.url, self.api_key,
                              timeout=self.connect_timeout, metrics_timeout=self.scrape_timeout,
                              clock=self.clock)

    def _take_info(self, info: ServerInfo, fresh: bool) -> None:
        """A (re)discovered server: tell the window, and start the rates over."""
        self.info = info
        self.welcome = info.welcome
        if fresh:
            self._window.clear()
        self.connected.emit(info)
        self._set_problem(info.metrics_note if not info.per_block else "")
        if info.first_scrape is not None and not info.per_block:
            self.metrics.emit(self._window.add(info.first_scrape))

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(0.025)
            self._flush()

    def _flush(self) -> None:
        if self._replies:
            batch, self._replies = self._replies, []
            self.replies.emit(batch)
        if self._frames:
            batch, self._frames = self._frames, []
            self.frames.emit(batch)
        gen = self._gen
        now = time.monotonic()
        if (gen.running or gen.in_flight) and now - self._last_stats > 0.25:
            self._last_stats = now
            self.load_stats.emit(gen.stats.as_dict() | {"running": gen.running})

    # --- liveness ------------------------------------------------------------------------
    def _lost(self, why: str) -> None:
        if not self._stalled:
            self._stalled = True
            log.warning("server %s not answering: %s", self.url, why)
            self.stalled.emit(why)

    async def _back(self) -> bool:
        """The server answers again: discover it anew (it may have restarted as something
        else). False while discovery still fails."""
        try:
            info = await self._discover()
        except (RemoteError, ValueError, httpx.HTTPError) as exc:
            log.info("server %s answers but is not back yet: %s", self.url, exc)
            return False
        self._stalled = False
        self._take_info(info, fresh=True)
        self.recovered.emit()
        return True

    def _set_problem(self, why: str) -> None:
        if why != self._problem:
            self._problem = why
            self.metrics_problem.emit(why)

    # --- /metrics --------------------------------------------------------------------------
    async def _watch_metrics(self) -> None:
        assert self._watch_http is not None
        while True:
            t0 = time.monotonic()
            await self._scrape_once()
            if self.info is not None and self.info.per_block:  # came back as a KVScope
                await self._watch_telemetry()
                return
            await asyncio.sleep(max(0.0, self.scrape_interval - (time.monotonic() - t0)))

    async def _scrape_once(self) -> None:
        assert self._watch_http is not None and self.info is not None
        try:
            text = await fetch_metrics_text(self._watch_http, self.url, self.api_key,
                                            self.scrape_timeout)
        except RemoteError as exc:
            if exc.status is None:  # no answer at all
                self._lost(str(exc))
                await asyncio.sleep(self.retry_interval)
                return
            problem = f"{exc}: this server exports no metrics here"
        except MetricsError as exc:
            problem = str(exc)
        else:
            try:  # the kind from the text each time: what answers may have changed
                scrape = await asyncio.to_thread(parse_scrape, text, self.clock(), None)
            except MetricsError as exc:
                problem = str(exc)
            else:
                if self._stalled:
                    await self._back()  # discovery takes the first scrape of the new server
                    return
                self._set_problem("" if scrape.kind in KINDS else
                                  "/metrics has none of the metric names this window knows")
                if scrape.kind != self.info.kind or scrape.missing != self.info.missing:
                    # a new object: the GUI thread may still be reading the one it was given
                    self.info = dataclasses.replace(self.info, kind=scrape.kind,
                                                    missing=scrape.missing)
                    self.connected.emit(self.info)
                self.metrics.emit(self._window.add(scrape))
                return
        # answered, but without readable metrics: alive all the same
        if self._stalled and not await self._back():
            return
        self._set_problem(problem)

    # --- KVScope telemetry -------------------------------------------------------------------
    async def _watch_telemetry(self) -> None:
        assert self._watch_http is not None
        watchdog = asyncio.create_task(self._telemetry_watchdog())
        try:
            while True:
                why = await self._follow_telemetry()
                self._lost(why)
                await asyncio.sleep(self.retry_interval)
                try:
                    welcome = await afetch_welcome(self._watch_http, self.url, self.api_key,
                                                   timeout=self.connect_timeout)
                except (RemoteError, httpx.HTTPError) as exc:
                    log.debug("welcome not yet: %s", exc)
                    continue
                if self.info is not None and welcome != self.info.welcome:
                    self.welcome = welcome  # a restarted engine
                    self.info = dataclasses.replace(self.info, welcome=welcome)
                    self.connected.emit(self.info)
        finally:
            watchdog.cancel()

    async def _follow_telemetry(self) -> str:
        """Frames until the stream ends; returns why it ended."""
        assert self._watch_http is not None
        self._last_frame = time.monotonic()
        try:
            async for snap in astream_telemetry(self._watch_http, self.url, self.api_key):
                self._last_frame = time.monotonic()
                if self._stalled:
                    self._stalled = False
                    self.recovered.emit()
                try:
                    self._frames.append(Frame.from_wire(snap))
                except (ValueError, TypeError) as exc:
                    log.warning("bad telemetry snapshot: %s", exc)
        except RemoteError as exc:
            return str(exc)
        except httpx.TimeoutException:
            return f"no telemetry from {self.url} for {self.scrape_timeout:.0f} s"
        except httpx.HTTPError as exc:
            return f"cannot reach {self.url}: {describe(exc)}"
        return "the server closed the telemetry stream"

    async def _telemetry_watchdog(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            silent = time.monotonic() - self._last_frame
            if silent > self.stall_timeout:
                self._lost(f"no telemetry from the server for {silent:.0f} s")

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
