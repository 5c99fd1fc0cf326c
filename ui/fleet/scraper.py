"""The fleet's HTTP side, on one worker thread with an asyncio loop (the GUI thread never waits
on a socket): each replica's /metrics scraped about twice a second into `MetricSample`s through
the same parsing and sliding window as the single-server view (app/remote/probe.py,
app/remote/samples.py), so the table's figures are that server's own; and a prompt tokenized
by every replica's /tokenize at once (each may run another tokenizer)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

import httpx
from PySide6.QtCore import QObject, Signal

from app.remote.fleet import Replica
from app.remote.kvscope_http import RemoteError
from app.remote.metrics import MetricsError
from app.remote.probe import fetch_metrics_text, parse_scrape
from app.remote.samples import ScrapeWindow
from app.remote.tokenize import atokenize

log = logging.getLogger(__name__)

Clock = Callable[[], float]


class FleetScraper(QObject):
    sample = Signal(int, object)  # replica index, app.remote.samples.MetricSample
    problem = Signal(int, str)  # replica index, why its /metrics is unread ("" once it reads)
    tokenized = Signal(int, int, object, str)  # ask id, replica, token ids or None, why not

    def __init__(self, replicas: list[Replica], *, api_key: str | None = None,
                 interval: float = 0.5, timeout: float = 10.0, window_s: float = 10.0,
                 clocks: list[Clock] | None = None,
                 parent: QObject | None = None) -> None:  # fmt: skip
        super().__init__(parent)
        self.replicas = list(replicas)
        self.api_key = api_key
        self.interval, self.timeout = interval, timeout
        # one clock per replica: tests script the scrapes' timestamps
        self.clocks = clocks or [time.monotonic] * len(replicas)
        self._windows = [ScrapeWindow(window_s) for _ in replicas]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self._main: asyncio.Task | None = None
        self._http: httpx.AsyncClient | None = None

    # --- GUI-thread API ---------------------------------------------------------------------
    def start(self) -> None:
        assert self._thread is None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="kvscope-fleet-http", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 3.0) -> None:
        loop = self._loop
        if loop is not None and not self._stopped.is_set():
            loop.call_soon_threadsafe(self._cancel)
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def tokenize(self, ask: int, prompt: str) -> None:
        """Ask every replica to tokenize `prompt`; each answers with `tokenized(ask, i, ...)`."""
        if self._loop is not None and not self._stopped.is_set():
            self._loop.call_soon_threadsafe(self._spawn_tokenize, ask, prompt)

    # --- worker thread ----------------------------------------------------------------------
    def _run(self) -> None:
        assert self._loop is not None
        asyncio.set_event_loop(self._loop)
        try:
            self._main = self._loop.create_task(self._serve())
            self._loop.run_until_complete(self._main)
        except asyncio.CancelledError:
            pass
        except Exception:  # the worker must never die silently
            log.exception("the fleet's HTTP worker failed")
        finally:
            self._stopped.set()
            self._finish_tokenizing()
            self._loop.close()

    def _finish_tokenizing(self) -> None:
        """Cancel tokenize requests still out and let them end before the loop closes."""
        assert self._loop is not None
        pending = asyncio.all_tasks(self._loop)
        for task in pending:
            task.cancel()
        if pending:
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))

    def _cancel(self) -> None:
        if self._main is not None:
            self._main.cancel()

    async def _serve(self) -> None:
        async with httpx.AsyncClient(timeout=self.timeout) as http:
            self._http = http
            await asyncio.gather(*(self._watch(i) for i in range(len(self.replicas))))

    async def _watch(self, i: int) -> None:
        while True:
            t0 = time.monotonic()
            await self._scrape(i)
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - t0)))

    async def _scrape(self, i: int) -> None:
        assert self._http is not None
        url = self.replicas[i].url
        try:
            text = await fetch_metrics_text(self._http, url, self.api_key, self.timeout)
            scrape = await asyncio.to_thread(parse_scrape, text, self.clocks[i](), None)
        except (RemoteError, MetricsError) as exc:
            self.problem.emit(i, str(exc))
            return
        self.problem.emit(i, "")
        self.sample.emit(i, self._windows[i].add(scrape))

    def _spawn_tokenize(self, ask: int, prompt: str) -> None:
        for i in range(len(self.replicas)):
            asyncio.ensure_future(self._tokenize(ask, i, prompt))

    async def _tokenize(self, ask: int, i: int, prompt: str) -> None:
        assert self._http is not None
        try:
            tokens = await atokenize(self._http, self.replicas[i].url, self.api_key, prompt,
                                     self.timeout)  # fmt: skip
        except RemoteError as exc:
            self.tokenized.emit(ask, i, None, str(exc))
            return
        self.tokenized.emit(ask, i, tokens, "")
