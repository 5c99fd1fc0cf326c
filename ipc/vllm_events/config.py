"""`--kv-events-config`: the JSON vLLM's `--kv-events-config` takes (vllm/config/kv_events.py,
`KVEventsConfig`), with the same keys and defaults, plus two of KVScope's own: `encoding` (the
payload layout: "map", vLLM's since PR #42892, or "array", vLLM <= 0.23's) and `hash_type`
("int": the low 64 bits of each block hash, vLLM's default; "bytes": the whole digest, vLLM's
VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0). docs/PROTOCOL.md, "KV events in vLLM's format".

Endpoints follow vLLM's rules: a PUB endpoint with `*` or `::` in it, or an ipc:// / inproc://
one, is bound, any other is connected to (a proxy's XSUB); the replay endpoint is always bound;
data-parallel rank r adds r to a tcp port (offset_endpoint_port).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

PUBLISHERS = ("zmq", "null")
ENCODINGS = ("map", "array")
HASH_TYPES = ("int", "bytes")


@dataclass(slots=True, frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str = "null"  # vLLM: "zmq" when events are enabled and no publisher is named
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # vLLM's publisher-thread queue; KVScope sends inline (unused)
    topic: str = ""
    encoding: str = "map"
    hash_type: str = "int"

    @property
    def active(self) -> bool:
        """Whether anything is published (vLLM publishes nothing otherwise, whatever else is
        set)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"


# key -> (accepted types, what the error says it must be); bool is not an int here.
_RULES: dict[str, tuple[tuple[type, ...], str]] = {
    "enable_kv_cache_events": ((bool,), "true or false"),
    "publisher": ((str,), " or ".join(repr(p) for p in PUBLISHERS)),
    "endpoint": ((str,), "a ZeroMQ endpoint string"),
    "replay_endpoint": ((str, type(None)), "a ZeroMQ endpoint string or null"),
    "buffer_steps": ((int,), "an integer >= 1"),
    "hwm": ((int,), "an integer >= 0"),
    "max_queue_size": ((int,), "an integer >= 1"),
    "topic": ((str,), "a string"),
    "encoding": ((str,), " or ".join(repr(e) for e in ENCODINGS)),
    "hash_type": ((str,), " or ".join(repr(h) for h in HASH_TYPES)),
}
_CHOICES = {"publisher": PUBLISHERS, "encoding": ENCODINGS, "hash_type": HASH_TYPES}
_MINIMUM = {"buffer_steps": 1, "hwm": 0, "max_queue_size": 1}


def parse_kv_events_config(text: str | dict[str, Any]) -> KVEventsConfig:
    """The config a JSON object (or its text) describes; ValueError naming the bad key and what
    it accepts."""
    obj = _load(text) if isinstance(text, str) else text
    if not isinstance(obj, dict):
        raise ValueError(f"must be a JSON object, got {type(obj).__name__}")
    allowed = [f.name for f in fields(KVEventsConfig)]
    for key, value in obj.items():
        if key not in _RULES:
            raise ValueError(f"unknown key {key!r} (allowed: {', '.join(allowed)})")
        _check(key, value)
    values = dict(obj)
    if values.get("publisher") is None:  # vLLM's __post_init__
        values["publisher"] = "zmq" if values.get("enable_kv_cache_events") else "null"
    return KVEventsConfig(**values)


def _load(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON: {exc}") from None


def _check(key: str, value: Any) -> None:
    types, must = _RULES[key]
    if key == "publisher" and value is None:
        return  # vLLM's default: chosen from enable_kv_cache_events
    ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
    if ok and key in _CHOICES:
        ok = value in _CHOICES[key]
    if ok and key in _MINIMUM:
        ok = value >= _MINIMUM[key]
    if ok and key in ("endpoint", "replay_endpoint") and value is not None:
        ok = "://" in value
    if not ok:
        raise ValueError(f"{key} must be {must}, got {value!r}")


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """vLLM's ZmqEventPublisher.offset_endpoint_port: each data-parallel rank publishes on its
    own endpoint, tcp port + rank (inproc: a `_dp<rank>` suffix); rank 0 keeps the endpoint."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{data_parallel_rank}"
    if "tcp" in endpoint:
        if ":" not in endpoint:
            return endpoint
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + data_parallel_rank}"
    raise ValueError("Invalid endpoint: must contain 'inproc' or 'tcp'")


def pub_binds(endpoint: str) -> bool:
    """vLLM's rule for the PUB socket: bind a wildcard or local-transport endpoint, connect to
    any other (a host:port names a peer to connect to, e.g. a proxy)."""
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )


def kv_events_config_arg(text: str) -> KVEventsConfig:
    """argparse `type=` for --kv-events-config: a bad value is a usage error naming the flag
    (argparse adds "argument --kv-events-config: ")."""
    import argparse

    try:
        return parse_kv_events_config(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def kv_events_json_arg(text: str) -> str:
    """argparse `type=` for a front-end that passes --kv-events-config on to the engine it
    spawns: checked here (a bad value is a usage error before any engine starts), kept as text."""
    kv_events_config_arg(text)
    return text
