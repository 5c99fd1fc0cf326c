"""The engine server's settings: its endpoints, telemetry rates, liveness timers and bounds."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_proc.server.disagg import DisaggConfig
from ipc import endpoints as E
from ipc import protocol as P
from ipc.vllm_events.config import KVEventsConfig


@dataclass(slots=True)
class ServerConfig:
    endpoint: str = E.DEFAULT_ENDPOINT
    pub_endpoint: str = E.DEFAULT_PUB_ENDPOINT
    telemetry_hz: float = 20.0
    heartbeat_interval: float = P.DEFAULT_HEARTBEAT_INTERVAL
    client_timeout: float = P.DEFAULT_CLIENT_TIMEOUT
    idle_telemetry_hz: float = 1.0  # snapshots per second while nothing runs
    allow_remote: bool = False
    token: str | None = None
    max_pending: int = 4096  # requests in flight over all clients
    kv_events: bool = True  # publish KV cache events (topic kv_events, ipc/kv_events.py)
    disagg: DisaggConfig = field(default_factory=DisaggConfig)  # --role prefill|decode
    vllm_events: KVEventsConfig | None = None  # --kv-events-config: vLLM-format KV events

    def __post_init__(self) -> None:
        if not self.telemetry_hz > 0:
            raise ValueError(f"telemetry_hz must be > 0, got {self.telemetry_hz!r}")
        if not self.heartbeat_interval > 0:
            raise ValueError(f"heartbeat_interval must be > 0, got {self.heartbeat_interval!r}")
        if not self.client_timeout > self.heartbeat_interval:
            raise ValueError(
                f"client_timeout must be > heartbeat_interval ({self.heartbeat_interval}), "
                f"got {self.client_timeout!r}"
            )
        if self.max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {self.max_pending!r}")
        for ep in (self.endpoint, self.pub_endpoint):
            E.check_bind(ep, self.allow_remote, self.token)
