"""Synthetic chat load: N concurrent conversations through the ordinary protocol.

`LoadGenerator` is a plain state machine (no Qt, no sockets): whoever owns an
`ipc.client.EngineConnection` asks it what to submit, and tells it what finished. The GUI's worker
thread drives it next to the chat panel's requests; `run()` drives it on a connection of its own
(`python -m app.load_generator --connect ENDPOINT -n 32 --duration 20`).

Every request shares one system prompt of a chosen length (so the prefix cache has something to
hit) and then varies: different user turns, different output lengths.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

ID_PREFIX = "load-"

_WORDS = (
    "cache block token prefix paged attention scheduler batch decode prefill latency memory "
    "river mountain garden library coffee bicycle violin harbor lantern meadow compass orbit "
    "pepper marble thunder willow copper silver ember falcon glacier"
).split()
_TOPICS = (
    "a short poem about {}", "three facts about {}", "a story that involves {} and {}",
    "how {} relates to {}", "a haiku on {}", "why {} matters", "a recipe using {}",
    "a riddle whose answer is {}", "a limerick about {} and {}", "the history of {}",
)


@dataclass(slots=True)
class LoadConfig:
    concurrency: int = 8  # chats in flight at once
    system_prompt_tokens: int = 256  # approximate length of the shared system prompt (words)
    min_output_tokens: int = 16
    max_output_tokens: int = 128
    temperature: float = 0.8
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.concurrency, int) or not 1 <= self.concurrency <= 1024:
            raise ValueError(f"concurrency must be an integer in [1, 1024], got "
                             f"{self.concurrency!r}")
        if not isinstance(self.system_prompt_tokens, int) or self.system_prompt_tokens < 0:
            raise ValueError(f"system_prompt_tokens must be an integer >= 0, got "
                             f"{self.system_prompt_tokens!r}")
        if not 1 <= self.min_output_tokens <= self.max_output_tokens:
            raise ValueError(
                "min_output_tokens and max_output_tokens must satisfy 1 <= min <= max, got "
                f"{self.min_output_tokens!r} and {self.max_output_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")


@dataclass(slots=True)
class LoadStats:
    submitted: int = 0
    finished: int = 0
    errors: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    in_flight: int = 0
    started: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(slots=True)
class LoadRequest:
    request_id: str
    messages: list[dict]
    sampling: dict


def system_prompt(n_words: int, seed: int = 0) -> str:
    """A deterministic system prompt of about `n_words` words (roughly as many tokens)."""
    rng = random.Random(seed)
    head = "You are a concise assistant. Answer in plain prose. "
    words = [rng.choice(_WORDS) for _ in range(max(0, n_words - 9))]
    return head + " ".join(words)


@dataclass
class LoadGenerator:
    config: LoadConfig = field(default_factory=LoadConfig)
    stats: LoadStats = field(default_factory=LoadStats)

    def __post_init__(self) -> None:
        self.running = False
        self._rng = random.Random(self.config.seed)
        self._ids = itertools.count(1)
        self._in_flight: set[str] = set()
        self._system = system_prompt(self.config.system_prompt_tokens, self.config.seed)

    @staticmethod
    def owns(request_id: str) -> bool:
        return request_id.startswith(ID_PREFIX)

    @property
    def in_flight(self) -> set[str]:
        return set(self._in_flight)

    def start(self, config: LoadConfig | None = None) -> None:
        if config is not None:
            self.config = config
            self._rng = random.Random(config.seed)
            self._system = system_prompt(config.system_prompt_tokens, config.seed)
        self.stats = LoadStats(started=time.monotonic())
        self.running = True

    def stop(self) -> list[str]:
        """Stop submitting; returns the ids still in flight (the caller aborts them)."""
        self.running = False
        return sorted(self._in_flight)

    def next_requests(self) -> list[LoadRequest]:
        """Requests to submit now so that `concurrency` are in flight."""
        if not self.running:
            return []
        out = []
        while len(self._in_flight) < self.config.concurrency:
            out.append(self._make())
        return out

    def _make(self) -> LoadRequest:
        c, rng = self.config, self._rng
        rid = f"{ID_PREFIX}{next(self._ids)}-{rng.getrandbits(24):06x}"
        topic = rng.choice(_TOPICS).format(*(rng.choice(_WORDS) for _ in range(2)))
        messages = [{"role": "system", "content": self._system}] if self._system else []
        messages.append({"role": "user", "content": f"Write {topic}."})
        sampling = {
            "max_tokens": rng.randint(c.min_output_tokens, c.max_output_tokens),
            "temperature": c.temperature,
            "seed": rng.getrandbits(31),
            "ignore_eos": True,  # output lengths as chosen, not as the model likes
        }
        self._in_flight.add(rid)
        self.stats.submitted += 1
        self.stats.in_flight = len(self._in_flight)
        return LoadRequest(rid, messages, sampling)

    def on_delta(self, request_id: str, num_tokens: int) -> None:
        if request_id in self._in_flight:
            self.stats.generated_tokens += num_tokens

    def on_finish(self, request_id: str, prompt_tokens: int = 0, cached_tokens: int = 0,
                  error: bool = False) -> None:
        if request_id not in self._in_flight:
            return
        self._in_flight.discard(request_id)
        self.stats.in_flight = len(self._in_flight)
        if error:
            self.stats.errors += 1
        else:
            self.stats.finished += 1
            self.stats.prompt_tokens += prompt_tokens
            self.stats.cached_tokens += cached_tokens

    def forget_all(self) -> None:
        """The engine went away: nothing is in flight any more."""
        for rid in list(self._in_flight):
            self.on_finish(rid, error=True)


def drive(conn: Any, gen: LoadGenerator, messages: list[Any]) -> None:
    """Feed `gen` the replies in `messages` (from EngineConnection.poll) and submit new work."""
    from ipc import protocol as P  # lazy: keep the core importable without pyzmq

    for msg in messages:
        rid = getattr(msg, "request_id", None)
        if rid is None or not gen.owns(rid):
            continue
        if isinstance(msg, P.Delta):
            gen.on_delta(rid, len(msg.token_ids))
        elif isinstance(msg, P.Finish):
            gen.on_finish(rid, msg.usage.prompt_tokens, msg.usage.cached_tokens,
                          error=msg.reason == "error")
        elif isinstance(msg, P.Error) and msg.code != P.ERR_UNKNOWN_REQUEST:
            gen.on_finish(rid, error=True)
    for req in gen.next_requests():
        conn.submit_generate(req.request_id, messages=req.messages, sampling=req.sampling)


def run(endpoint: str, config: LoadConfig, duration: float, token: str | None = None,
        stop: threading.Event | None = None) -> LoadStats:
    """Run the load on a connection of our own for `duration` seconds (or until `stop` is set),
    then abort what is left."""
    from ipc.client import EngineConnection

    conn = EngineConnection(endpoint, token=token, client_name="load")
    try:
        conn.hello()
        gen = LoadGenerator(config)
        gen.start()
        end = time.monotonic() + duration
        while time.monotonic() < end and not (stop is not None and stop.is_set()):
            drive(conn, gen, conn.poll(50))
        for rid in gen.stop():
            conn.submit_abort(rid)
        return gen.stats
    finally:
        conn.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m app.load_generator",
                                 description="Synthetic concurrent chats against an engine.")
    ap.add_argument("--connect", required=True, help="engine endpoint, e.g. tcp://127.0.0.1:5557")
    ap.add_argument("-n", "--concurrency", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=256)
    ap.add_argument("--min-out", type=int, default=16)
    ap.add_argument("--max-out", type=int, default=128)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--token", default=None)
    a = ap.parse_args(argv)
    cfg = LoadConfig(a.concurrency, a.system_tokens, a.min_out, a.max_out)
    stats = run(a.connect, cfg, a.duration, a.token)
    el = max(time.monotonic() - stats.started, 1e-9)
    print(f"submitted {stats.submitted}, finished {stats.finished}, errors {stats.errors}, "
          f"generated {stats.generated_tokens} tokens ({stats.generated_tokens / el:.1f} tok/s), "
          f"prompt {stats.prompt_tokens} of which cached {stats.cached_tokens}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
