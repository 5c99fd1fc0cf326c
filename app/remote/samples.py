"""Scrapes of /metrics -> what the window draws: one `MetricSample` per scrape, with the gauges
of that scrape and the counter rates, prefix hit rate and latency quantiles over a sliding
window of recent scrapes (as the ZeroMQ view computes its rates over its last 10 s of frames).

A value the server does not export is None *and* named in `missing`; a value that is reported
but has nothing to say yet (no second scrape, no request in the window) is None without being
missing. The window shows the first as "not reported by this server", the second as "—".
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from app.remote.metrics import (
    HistogramValue,
    Rank,
    Scrape,
    counter_delta,
    hit_rate,
    rate,
    window_quantiles,
)

QUANTILES = (0.5, 0.9, 0.99)


@dataclass(slots=True)
class RankSample:
    """One data-parallel / tensor-parallel rank's share (None: not reported for this rank)."""

    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    prompt_tps: float | None = None
    gen_tps: float | None = None
    hit_rate: float | None = None


@dataclass(slots=True)
class MetricSample:
    time: float  # the scrape's clock (seconds)
    kind: str
    window_s: float  # the span the rates and quantiles cover (0: first scrape)
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None  # 0..1, the mean over ranks
    hit_rate: float | None = None  # prefix-cache hits / queries over the window
    prompt_tps: float | None = None
    gen_tps: float | None = None
    preemptions_per_s: float | None = None
    ttft: dict[float, float | None] | None = None  # quantile -> seconds
    itl: dict[float, float | None] | None = None
    ranks: dict[Rank, RankSample] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)  # canonical names not exported
    num_blocks: int | None = None  # per rank (vLLM's cache_config_info)
    block_size: int | None = None
    capacity_tokens: float | None = None  # per rank (SGLang's max_total_num_tokens)

    def reported(self, name: str) -> bool:
        return name not in self.missing


class ScrapeWindow:
    """The recent scrapes of one server; `add` turns each new one into a MetricSample."""

    def __init__(self, window_s: float = 10.0) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        self.window_s = window_s
        self.scrapes: deque[Scrape] = deque()

    def clear(self) -> None:
        self.scrapes.clear()

    def add(self, scrape: Scrape) -> MetricSample:
        h = self.scrapes
        if h and (scrape.kind != h[-1].kind or scrape.time < h[-1].time):
            h.clear()  # another server behind the URL, or a clock that went back
        h.append(scrape)
        # keep at least window_s of history: drop the oldest only while the next one still
        # reaches back a full window
        while len(h) > 2 and scrape.time - h[1].time >= self.window_s:
            h.popleft()
        return sample_between(h[0], scrape)


def sample_between(old: Scrape, new: Scrape) -> MetricSample:
    """The sample of `new`, with rates and quantiles over (old, new] (none when old is new)."""
    first = old is new or new.time <= old.time
    s = MetricSample(
        time=new.time,
        kind=new.kind,
        window_s=0.0 if first else new.time - old.time,
        running=new.total("running"),
        waiting=new.total("waiting"),
        kv_usage=new.total("kv_usage"),
        missing=new.missing,
        num_blocks=new.num_blocks,
        block_size=_int_or_none(new.cache_info.get("block_size")),
        capacity_tokens=new.capacity_tokens,
    )
    if not first:
        s.hit_rate = hit_rate(old, new)
        s.prompt_tps = rate(old, new, "prompt_tokens")
        s.gen_tps = rate(old, new, "generation_tokens")
        s.preemptions_per_s = rate(old, new, "preemptions")
        s.ttft = window_quantiles(old, new, "ttft", QUANTILES)
        s.itl = window_quantiles(old, new, "itl", QUANTILES)
    s.ranks = _ranks(old, new, first)
    return s


def _ranks(old: Scrape, new: Scrape, first: bool) -> dict[Rank, RankSample]:
    out: dict[Rank, RankSample] = {}
    dt = new.time - old.time
    for rank in new.ranks:
        r = RankSample(
            running=_value(new, "running", rank),
            waiting=_value(new, "waiting", rank),
            kv_usage=_value(new, "kv_usage", rank),
        )
        if not first:
            r.prompt_tps = _rank_rate(old, new, "prompt_tokens", rank, dt)
            r.gen_tps = _rank_rate(old, new, "generation_tokens", rank, dt)
            q = _rank_delta(old, new, "prefix_queries", rank)
            k = _rank_delta(old, new, "prefix_hits", rank)
            r.hit_rate = k / q if q and k is not None else None
        out[rank] = r
    return out


def _value(s: Scrape, name: str, rank: Rank) -> float | None:
    v = s.values.get(name, {}).get(rank)
    return None if v is None or isinstance(v, HistogramValue) else v


def _rank_delta(old: Scrape, new: Scrape, name: str, rank: Rank) -> float | None:
    a, b = _value(old, name, rank), _value(new, name, rank)
    return None if a is None or b is None else counter_delta(a, b)


def _rank_rate(old: Scrape, new: Scrape, name: str, rank: Rank, dt: float) -> float | None:
    d = _rank_delta(old, new, name, rank)
    return None if d is None or dt <= 0 else d / dt


def _int_or_none(raw: str | None) -> int | None:
    try:
        return int(float(raw)) if raw not in (None, "", "None") else None
    except ValueError:
        return None
