"""The window's door to a server over HTTP: vLLM, SGLang, llama.cpp's server, or a KVScope
front-end (`kvscope serve`) — `python -m app --connect http://HOST:PORT`.

`RemoteLink` has the signals the window already takes from ui/engine/link.py where they apply
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
The chats and the load generator are in ui/remote/chats.py, the watcher of a disaggregated
deployment (two engines' telemetry, `role_frames`) in ui/remote/disagg.py.
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
from app.remote.kvscope_http import ROLES, RemoteError, afetch_welcome, astream_telemetry
from app.remote.metrics import KINDS, MetricsError
from app.remote.openai_client import describe
from app.remote.probe import (
    ServerInfo,
    discover,
    discover_deployment,
    fetch_metrics_text,
    normalize_url,
    parse_scrape,
)
from app.remote.samples import ScrapeWindow
from ipc import protocol as P
from ui.remote.chats import ERR_SERVER, ChatStreams
from ui.remote.disagg import DisaggFollower
from ui.telemetry import Frame

__all__ = ["ERR_SERVER", "RemoteLink"]

log = logging.getLogger(__name__)


class RemoteLink(QObject, ChatStreams, DisaggFollower):
    connected = Signal(object)  # app.remote.probe.ServerInfo; again when it changes
    connect_failed = Signal(str)
    replies = Signal(list)  # Delta / Finish / Error of the window's chats
    frames = Signal(list)  # list[Frame] (KVScope servers with one engine)
    # a disaggregated KVScope deployment: {role: list[Frame]} for its prefill and decode engines,
    # and (role, why it is down; "" once its telemetry flows again)
    role_frames = Signal(dict)
    engine_status = Signal(str, str)
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
        self._role_frames: dict[str, list[Frame]] = {role: [] for role in ROLES}
        self._role_why: dict[str, str] = dict.fromkeys(ROLES, "")
        self._role_last: dict[str, float] = dict.fromkeys(ROLES, 0.0)
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
                watcher = asyncio.create_task(self._watch())
                watcher.add_done_callback(self._watcher_done)
                await asyncio.Event().wait()  # until cancelled by stop()
            finally:
                tasks = [flusher, *([watcher] if watcher else []), *self._chats.values(),
                         *self._loads.values()]
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _watch(self) -> None:
        """The watcher for what the server is; a server that comes back as another kind hands
        over to that kind's watcher."""
        while True:
            info = self.info
            assert info is not None
            if info.disaggregated:
                await self._watch_disagg()
            elif info.per_block:
                await self._watch_telemetry()
            else:
                await self._watch_metrics()

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
        if any(self._role_frames.values()):
            by_role = {role: frames for role, frames in self._role_frames.items() if frames}
            self._role_frames = {role: [] for role in ROLES}
            self.role_frames.emit(by_role)
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
                    deployment = await discover_deployment(self._watch_http, self.url,
                                                           self.api_key, self.connect_timeout)
                    if deployment is not None and deployment.disaggregated and await self._back():
                        return  # restarted as a prefill/decode pair: _watch takes it from here
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
