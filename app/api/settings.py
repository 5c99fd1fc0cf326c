"""The HTTP server's settings (`kvscope serve`'s bounds, keys and names) and what counts as a
loopback host."""

from __future__ import annotations

from dataclasses import dataclass, field

LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})


def is_loopback_host(host: str) -> bool:
    h = host.strip("[]").lower()
    return h in ("localhost", "::1") or h.startswith("127.")


@dataclass(slots=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: list[str] = field(default_factory=list)  # empty: no key needed
    served_model_names: list[str] = field(default_factory=list)  # empty: the engine's name
    max_body_bytes: int = 1 << 20
    max_pending: int = 256  # API calls in flight
    max_n: int = 16
    max_tokens: int | None = None  # per sequence; None: max_model_len
    cors_origins: list[str] = field(default_factory=list)
    allowed_hosts: list[str] = field(default_factory=list)  # extra Host names on loopback
    tool_call_parser: str | None = None  # None: the family the engine detected (app/api/tools/)

    @property
    def loopback(self) -> bool:
        return is_loopback_host(self.host)
