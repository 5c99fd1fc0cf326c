"""A KV event publisher the window subscribes to (`--kv-events tcp://HOST:5557
[--kv-events-replay tcp://HOST:5558]`, or the connect dialog's fields): vLLM's or SGLang's
`--kv-events-config` publisher, or KVScope's engine publishing that format.

The endpoints are what the subscriber connects to, so a host is needed: the publisher's
`tcp://*:5557` is where it binds, not where it is found. vLLM and SGLang offset the port by the
data-parallel rank: rank r publishes on port + r, one source each.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ENDPOINT_FORMS = "tcp://HOST:PORT (e.g. tcp://10.0.0.5:5557) or ipc://PATH"
_TCP = re.compile(r"^tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):(\d{1,5})$")


@dataclass(slots=True, frozen=True)
class KvEventsSource:
    endpoint: str  # the PUB socket
    replay: str | None = None  # the ROUTER answering replay requests (optional)
    topic: str = ""  # subscribe to topics starting with this ("" = all)

    @property
    def name(self) -> str:
        """How views and the fleet tree name this source."""
        return self.endpoint


def check_endpoint(value: str, field: str) -> str:
    """`value` stripped, or ValueError naming `field` and the forms allowed."""
    v = (value or "").strip()
    if v.startswith("ipc://") and len(v) > len("ipc://"):
        return v
    m = _TCP.match(v)
    if m and 0 < int(m.group(2)) < 65536:
        return v
    hint = " (that is where a publisher binds; name its host)" if "*" in v else ""
    raise ValueError(f"{field}: {v!r} is not an endpoint to connect to{hint}; "
                     f"use {ENDPOINT_FORMS}")


def make_source(endpoint: str | None, replay: str | None = None, topic: str = "",
                fields: tuple[str, str] = ("KV events endpoint", "replay endpoint"),
                ) -> KvEventsSource | None:  # fmt: skip
    """The source from user input (None when no endpoint was given); ValueError naming the
    field that is wrong. A replay endpoint needs an events endpoint."""
    endpoint, replay = (endpoint or "").strip(), (replay or "").strip()
    if not endpoint:
        if replay:
            raise ValueError(f"{fields[1]}: given without a {fields[0]}")
        return None
    return KvEventsSource(check_endpoint(endpoint, fields[0]),
                          check_endpoint(replay, fields[1]) if replay else None, topic)
