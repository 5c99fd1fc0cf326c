"""The HTTP server's hold on its engine (app/serve.py): spawn or attach, notice it going
away, restart or reattach."""

from __future__ import annotations

import argparse
import asyncio
import logging
import shlex
import sys
from typing import Any

from app.api.server import EngineLink
from app.supervisor import (
    APP_DECODE_ACTIVATIONS,
    EngineOptions,
    EngineSupervisor,
    engine_command,
)
from ipc.client import EngineError

log = logging.getLogger("app.serve")


def _print_progress(fraction: float, message: str) -> None:
    sys.stderr.write(f"\r[engine {fraction * 100:5.1f}%] {message[:60]:<60}")
    sys.stderr.flush()


RESTART_BACKOFF = (1.0, 2.0, 4.0, 8.0, 16.0)  # seconds before restart 1, 2, ...; then give up
RESTART_WINDOW = 300.0  # restarts older than this are forgotten


def engine_options(a: argparse.Namespace) -> EngineOptions:
    """`kvscope serve`'s engine flags -> the spawned engine's options."""
    return EngineOptions(
        model=a.model, dtype=a.dtype, device=a.device, num_kv_blocks=a.num_kv_blocks,
        max_model_len=a.max_model_len, decode_weights=a.decode_weights,
        decode_activations=getattr(a, "decode_activations", None) or APP_DECODE_ACTIVATIONS,
        kv_cache_dtype=a.kv_cache_dtype, kv_host_memory=a.kv_host_memory,
        kv_disk_dir=a.kv_disk_dir, kv_disk_bytes=a.kv_disk_bytes,
        kv_events_config=getattr(a, "kv_events_config", None),  # absent from older namespaces
        extra_args=shlex.split(a.engine_args),
    )  # fmt: skip


class EngineKeeper:
    """Keeps the link to the engine: spawns it (or attaches), notices it going away, restarts a
    spawned engine that dies after it was ready (with backoff), and reattaches to a --connect
    endpoint that answers again. A spawned engine that never got ready (a model that does not
    load) stops the server: `on_fatal` gets why."""

    def __init__(
        self,
        link: EngineLink,
        args: argparse.Namespace,
        token: str | None,
        on_fatal: Any = None,
    ) -> None:
        self.link = link
        self.args = args
        self.token = token
        self.on_fatal = on_fatal
        self.endpoint: str | None = args.connect
        self.supervisor: EngineSupervisor | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stopping = False
        self.restarts: list[float] = []  # loop times of recent restarts

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        if self.endpoint is None:
            self._spawn()
        self.task = asyncio.create_task(self._watch())

    def _spawn(self) -> None:
        options = engine_options(self.args)
        assert self.loop is not None
        loop = self.loop

        def ready(info: dict[str, Any]) -> None:
            sys.stderr.write("\n")
            loop.call_soon_threadsafe(self._on_ready, str(info["endpoint"]))

        supervisor = EngineSupervisor(
            engine_command(options), on_progress=_print_progress, on_ready=ready,
            on_exit=lambda code: loop.call_soon_threadsafe(self._on_exit, supervisor, code),
        )  # fmt: skip
        self.supervisor = supervisor
        self.endpoint = None
        supervisor.start()

    def _on_ready(self, endpoint: str) -> None:
        self.endpoint = endpoint

    def _on_exit(self, supervisor: EngineSupervisor, code: int) -> None:
        if self.stopping or supervisor is not self.supervisor:
            return
        tail = " | ".join(supervisor.tail(5))
        why = f"the engine exited with code {code}: {tail}"
        self.link.mark_gone(why)
        self.endpoint = None
        if supervisor.ready_info is None:
            log.error("the engine did not start: %s", why)
            if self.on_fatal is not None:
                self.on_fatal(why)
            return
        if self.args.no_restart:
            return
        assert self.loop is not None
        now = self.loop.time()
        self.restarts = [t for t in self.restarts if now - t < RESTART_WINDOW]
        if len(self.restarts) >= len(RESTART_BACKOFF):
            log.error("the engine died %d times in %.0f s; not restarting it again",
                      len(self.restarts) + 1, RESTART_WINDOW)  # fmt: skip
            return
        delay = RESTART_BACKOFF[len(self.restarts)]
        self.restarts.append(now)
        log.warning("%s; restarting it in %.0f s", why, delay)
        self.link.detail = f"{why}; restarting it"
        self.loop.call_later(delay, self._restart)

    def _restart(self) -> None:
        if not self.stopping:
            self.link.status, self.link.detail = "loading", "the engine is restarting"
            self._spawn()

    async def _watch(self) -> None:
        while True:
            client = self.link.client
            if client is not None and client.state != "ready" and self.link.status == "ready":
                self.link.mark_gone(client.gone_reason or "the engine went away")
            spawned_dead = self.supervisor is not None and not self.supervisor.running()
            if self.endpoint and self.link.status != "ready" and not spawned_dead:
                try:
                    await self.link.attach(self.endpoint, self.token, timeout=2.0)
                    log.info("attached to the engine at %s", self.endpoint)
                except EngineError as exc:
                    if self.link.status != "loading":
                        self.link.mark_gone(f"the engine at {self.endpoint} does not answer: {exc}")
            await asyncio.sleep(0.5)

    async def stop(self) -> None:
        self.stopping = True
        if self.link.client is not None:
            await self.link.client.close()
        if self.supervisor is not None:
            await asyncio.to_thread(self.supervisor.stop)
