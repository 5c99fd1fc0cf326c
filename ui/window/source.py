"""What the window is attached to: an engine it spawns (with the options it starts with), an engine
over ZeroMQ, a server watched over HTTP, or the demo."""

from __future__ import annotations

from dataclasses import dataclass, field

from app.remote.kv_events_source import KvEventsSource
from app.remote.probe import is_http_url
from app.supervisor import EngineOptions


@dataclass(slots=True)
class EngineSource:
    # attach to this endpoint instead of spawning: tcp://... (an engine), http(s)://... (a
    # server watched over HTTP: ui/remote/link.py), demo://
    connect: str | None = None
    options: EngineOptions = field(default_factory=EngineOptions)
    # Engine command without option flags (tests); `options.to_args()` is appended at start.
    # Default: engine_command(options).
    command: list[str] | None = None
    token: str | None = None
    api_key: str | None = None  # for an http(s):// server (never stored)
    # the server's KV event publisher (vLLM's format), followed beside it (ui/window/kv_events.py)
    kv_events: KvEventsSource | None = None
    # more keyword arguments for ui.remote.link.RemoteLink (tests: a scripted clock, intervals)
    link_options: dict = field(default_factory=dict)
    stall_timeout: float = 30.0  # one CPU step under load can take seconds
    # the spawned engine runs at a lower CPU priority so that, when the cores are contended
    # (CPU inference), the window stays responsive; 0 = same priority as the GUI
    engine_nice: int = 5

    @property
    def is_remote(self) -> bool:
        """Watching a server over HTTP (not an engine over ZeroMQ)."""
        return is_http_url(self.connect)

    @property
    def is_demo(self) -> bool:
        return bool(self.connect and self.connect.startswith("demo:"))
