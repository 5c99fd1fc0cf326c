"""RemoteLink's watcher for a disaggregated KVScope deployment (`kvscope serve --disaggregated`,
docs/PROTOCOL.md sections 9 and 10), mixed into ui/remote/link.py's RemoteLink and run on its
worker thread: one task per engine follows `GET /kvscope/telemetry?engine=ROLE`, and one keeps an
eye on the deployment as a whole.

An engine that is down (the front-end answers 503 for it, or its stream ends) is that engine's
news (`engine_status(role, why)`); the other engine's telemetry flows on. Only when the server
itself does not answer, or neither engine has sent anything for `stall_timeout`, is the server
lost (`stalled`); when it answers again it is discovered anew, and a server that came back as
something else than a disaggregated deployment hands over to the ordinary watchers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

import httpx

from app.remote.kvscope_http import (
    ROLES,
    RemoteError,
    afetch_deployment,
    afetch_welcome,
    astream_telemetry,
)
from app.remote.openai_client import describe
from app.remote.probe import ServerInfo
from ui.telemetry import Frame

log = logging.getLogger("ui.remote.link")


class DisaggFollower:
    """The disaggregated half of RemoteLink (its attributes and signals, set by RemoteLink)."""

    url: str
    api_key: str | None
    info: ServerInfo | None
    retry_interval: float
    stall_timeout: float
    scrape_timeout: float
    connect_timeout: float
    _stalled: bool
    _watch_http: httpx.AsyncClient | None
    _role_frames: dict[str, list[Frame]]
    _role_why: dict[str, str]
    _role_last: dict[str, float]
    connected: Any  # RemoteLink's signals
    recovered: Any
    engine_status: Any

    if TYPE_CHECKING:  # RemoteLink's

        def _lost(self, why: str) -> None: ...
        async def _back(self) -> bool: ...

    async def _watch_disagg(self) -> None:
        """Both engines' telemetry, until the server turns out not to be a disaggregated
        deployment any more (then self.info says what it is)."""
        now = time.monotonic()
        self._role_last = dict.fromkeys(ROLES, now)
        self._role_why = dict.fromkeys(ROLES, "")
        self._welcome_tasks: dict[str, asyncio.Task] = {}
        tasks = [asyncio.create_task(self._follow_role(role)) for role in ROLES]
        tasks.append(asyncio.create_task(self._disagg_watchdog()))
        try:
            while self.info is not None and self.info.disaggregated:
                await asyncio.sleep(self.retry_interval)
                if self._stalled or any(self._role_why.values()):
                    await self._check_deployment()
        finally:
            tasks += self._welcome_tasks.values()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _check_deployment(self) -> None:
        """While something is wrong: is it still the same kind of server?"""
        assert self._watch_http is not None
        try:
            deployment = await afetch_deployment(self._watch_http, self.url, self.api_key,
                                                 timeout=self.connect_timeout)
        except (RemoteError, httpx.HTTPError):
            return  # not answering: the followers keep trying
        if self._stalled or deployment is None or not deployment.disaggregated:
            await self._back()  # discovered anew; `connected` tells the window

    async def _follow_role(self, role: str) -> None:
        while True:
            why, answered = await self._stream_role(role)
            if answered:
                self._role_down(role, why)
            else:
                self._lost(why)
            await asyncio.sleep(self.retry_interval)
            if not self._stalled:
                await self._refresh_welcome(role)  # a restarted engine has a new welcome

    async def _stream_role(self, role: str) -> tuple[str, bool]:
        """One engine's frames until its stream ends: why it ended, and whether the server
        answered (an engine of the deployment is down) or not (the server is lost)."""
        assert self._watch_http is not None
        self._role_last[role] = time.monotonic()
        try:
            async for snap in astream_telemetry(self._watch_http, self.url, self.api_key,
                                                engine=role):
                self._role_last[role] = time.monotonic()
                if self._role_why[role]:  # back: perhaps as another process than we knew
                    self._role_why[role] = ""
                    self.engine_status.emit(role, "")
                    self._welcome_tasks[role] = asyncio.create_task(self._refresh_welcome(role))
                if self._stalled:
                    self._stalled = False
                    self.recovered.emit()
                try:
                    self._role_frames[role].append(Frame.from_wire(snap))
                except (ValueError, TypeError) as exc:
                    log.warning("bad %s telemetry snapshot: %s", role, exc)
        except RemoteError as exc:
            return str(exc), exc.status is not None
        except httpx.TimeoutException:
            return f"no telemetry from {self.url} for {self.scrape_timeout:.0f} s", False
        except httpx.HTTPError as exc:
            return f"cannot reach {self.url}: {describe(exc)}", False
        return f"the {role} engine's telemetry stream ended", True

    def _role_down(self, role: str, why: str) -> None:
        if why != self._role_why.get(role):
            self._role_why[role] = why
            log.info("%s engine of %s: %s", role, self.url, why)
            self.engine_status.emit(role, why)

    async def _refresh_welcome(self, role: str) -> None:
        """An engine that comes back may be another process (restarted): its welcome tells."""
        assert self._watch_http is not None
        try:
            welcome = await afetch_welcome(self._watch_http, self.url, self.api_key,
                                           timeout=self.connect_timeout, engine=role)
        except (RemoteError, httpx.HTTPError) as exc:
            log.debug("%s welcome not yet: %s", role, exc)
            return
        info = self.info
        if info is None or info.deployment is None or not info.disaggregated:
            return
        if info.deployment.welcomes.get(role) != welcome:
            # new objects: the GUI thread may still be reading the ones it was given
            welcomes = {**info.deployment.welcomes, role: welcome}
            deployment = dataclasses.replace(info.deployment, welcomes=welcomes)
            self.info = dataclasses.replace(info, deployment=deployment)
            self.connected.emit(self.info)

    async def _disagg_watchdog(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            now = time.monotonic()
            silent = {role: now - t for role, t in self._role_last.items()}
            for role, s in silent.items():
                if s > self.stall_timeout and not self._role_why[role]:
                    self._role_down(role, f"no telemetry from the {role} engine for {s:.0f} s")
            if min(silent.values()) > self.stall_timeout:
                self._lost(f"no telemetry from the server for {min(silent.values()):.0f} s")
