"""`kvscope serve --disaggregated`: a prefill engine, a decode engine and the router between
them, behind the one HTTP API.

Each engine has its own keeper (spawn or attach, restart with backoff: app/api/keeper.py), so
one dying leaves the other serving (the router sends it whole requests meanwhile). The CPU's
cores are split between the two engines' torch threads.
"""

from __future__ import annotations

import argparse
import copy
import logging
import shlex
from typing import Any

from app.api.errors import APIError
from app.api.keeper import EngineKeeper
from app.api.server import EngineLink
from app.router.router import DisaggRouter, mismatch, split_threads
from ipc import protocol as P
from ipc.async_client import AsyncEngineClient

log = logging.getLogger(__name__)


class DisaggLink:
    """What the HTTP app sees (the EngineLink interface): ready while either engine is, the
    router as its client."""

    def __init__(self) -> None:
        self.prefill = EngineLink()
        self.decode = EngineLink()
        self.router = DisaggRouter(
            lambda: _ready(self.prefill), lambda: _ready(self.decode), ("prefill", "decode")
        )
        self.progress = 0.0
        self.refused: str | None = None  # the two engines cannot be paired (checked once each)
        self._checked: tuple[int, int] | None = None

    @property
    def status(self) -> str:
        if self.refused is not None:
            return "gone"
        states = {self.prefill.status, self.decode.status}
        if "ready" in states:
            return "ready"
        return "loading" if "loading" in states else "gone"

    @property
    def detail(self) -> str:
        if self.refused is not None:
            return self.refused
        return f"prefill engine: {self.prefill.detail}; decode engine: {self.decode.detail}"

    @property
    def client(self) -> DisaggRouter | None:
        return self.router if self.status == "ready" else None

    @property
    def telemetry(self) -> P.Telemetry | None:
        return self.router.telemetry

    @property
    def model_info(self) -> P.ModelInfo:
        return self.router.model_info

    def ready_client(self) -> DisaggRouter:
        self._check_pair()
        if self.status != "ready" or self.router.state != "ready":
            raise APIError(503, f"the engines are not ready: {self.detail}",
                           code="engine_unavailable")  # fmt: skip
        return self.router

    def _check_pair(self) -> None:
        """Refuse to serve two engines that cannot share KV blocks (checked when both are up)."""
        p, d = _ready(self.prefill), _ready(self.decode)
        if p is None or d is None or self._checked == (id(p), id(d)):
            return
        self._checked = (id(p), id(d))
        self.refused = mismatch(p.model_info, d.model_info)
        if self.refused is not None:
            log.error("refusing the disaggregated pair: %s", self.refused)

    def mark_gone(self, why: str) -> None:
        self.decode.mark_gone(why)
        self.prefill.mark_gone(why)


def _ready(link: EngineLink) -> AsyncEngineClient | None:
    client = link.client
    if link.status == "ready" and client is not None and client.state == "ready":
        return client
    return None


def role_args(args: argparse.Namespace, role: str, threads: int) -> argparse.Namespace:
    """The serve options of one half: its role, its threads, its own --connect endpoint."""
    half = copy.copy(args)
    extra = ["--role", role, "--num-threads", str(threads)]
    half.engine_args = " ".join([args.engine_args, *map(shlex.quote, extra)]).strip()
    half.connect = args.connect_prefill if role == "prefill" else args.connect_decode
    return half


class DisaggKeeper:
    """Two EngineKeepers (app/api/keeper.py), one per role."""

    def __init__(self, link: DisaggLink, args: argparse.Namespace, token: str | None,
                 on_fatal: Any = None) -> None:  # fmt: skip

        p_threads, d_threads = split_threads(args.disagg_cores)
        log.info("disaggregated: prefill engine %d threads, decode engine %d threads",
                 p_threads, d_threads)  # fmt: skip
        self.keepers = [
            EngineKeeper(link.prefill, role_args(args, "prefill", p_threads), token, on_fatal),
            EngineKeeper(link.decode, role_args(args, "decode", d_threads), token, on_fatal),
        ]

    def start(self) -> None:
        for keeper in self.keepers:
            keeper.start()

    async def stop(self) -> None:
        for keeper in self.keepers:
            await keeper.stop()
