"""A fleet of servers watched at once (`--fleet URL=EVENTS[+REPLAY],...`, *Engine → Connect to
a fleet…*): one `Replica` per server, or per data-parallel rank of one (a URL each), with the
KV event publisher whose blocks the fleet's prefix tree draws.

'+' separates the events endpoint from its replay endpoint because neither a tcp:// endpoint
nor a URL has one, and ',' / '=' are already taken by the list and the pairing."""

from __future__ import annotations

from dataclasses import dataclass

from app.remote.kv_events_source import KvEventsSource, make_source
from app.remote.probe import normalize_url

FLEET_FORM = ("URL[=EVENTS[+REPLAY]],... e.g. "
              "http://A:8000=tcp://A:5557+tcp://A:5558,http://B:8000=tcp://B:5557")


@dataclass(slots=True, frozen=True)
class Replica:
    url: str  # the server's HTTP address (/metrics, /tokenize)
    kv_events: KvEventsSource | None = None

    @property
    def label(self) -> str:
        """How the table and the tree's hover name it: host:port."""
        return self.url.split("://", 1)[-1].rstrip("/")


def make_replica(url: str, events: str = "", replay: str = "", where: str = "--fleet"
                 ) -> Replica:  # fmt: skip
    """A replica from user input; ValueError naming `where` and the field that is wrong."""
    try:
        base = normalize_url(url)
    except ValueError as exc:
        raise ValueError(f"{where}: server URL {url!r}: {exc}") from None
    source = make_source(events, replay, fields=(f"{where}: KV events endpoint",
                                                 f"{where}: replay endpoint"))  # fmt: skip
    return Replica(base, source)


def parse_fleet(text: str) -> list[Replica]:
    """`--fleet`'s value -> the replicas; ValueError naming the flag and the allowed form."""
    items = [item.strip() for item in (text or "").split(",") if item.strip()]
    if not items:
        raise ValueError(f"--fleet: no server given; use {FLEET_FORM}")
    replicas = [_item(item) for item in items]
    check_distinct(replicas, "--fleet")
    return replicas


def _item(item: str) -> Replica:
    url, _, endpoints = item.partition("=")
    events, _, replay = endpoints.partition("+")
    if endpoints and not events.strip():
        raise ValueError(f"--fleet: {item!r} has no events endpoint after '='; use {FLEET_FORM}")
    return make_replica(url, events, replay)


def check_distinct(replicas: list[Replica], where: str) -> None:
    """Two rows with one URL or one publisher would count one server twice."""
    seen: set[str] = set()
    for r in replicas:
        for key in (r.url, r.kv_events.endpoint if r.kv_events else None):
            if key is None:
                continue
            if key in seen:
                raise ValueError(f"{where}: {key} is given twice")
            seen.add(key)
