"""The GUI's view of engine telemetry: one `Frame` per snapshot, and `History` of them for charts.

No Qt and no engine_proc here. `Frame.from_wire` accepts whatever the protocol layer decoded
(msgspec Structs, dataclasses or plain dicts with the fields of
engine_proc/engine/telemetry_types.py), so the widgets depend only on this module. `History` turns
the stream of frames into the ring-buffered series the charts draw. """

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from app.load_generator import ID_PREFIX as LOAD_ID_PREFIX
from ui.spec_history import SpecHistory

# Block states, as on the wire (engine_proc/engine/telemetry_types.py; duplicated because ui/ must
# not import engine_proc)
BLOCK_EMPTY = 0
BLOCK_CACHED = 1
BLOCK_IN_USE = 2


def _get(obj: Any, name: str, default: Any = None) -> Any:
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


def _as_dict(obj: Any) -> dict:
    """A plain dict from a dict, a msgspec Struct or a dataclass (None -> {})."""
    if obj is None:
        return {}
    if isinstance(obj, dict):
        return dict(obj)
    fields = getattr(obj, "__struct_fields__", None) or getattr(obj, "__dataclass_fields__", None)
    if fields is None:
        raise ValueError(f"expected a mapping or a struct, got {type(obj).__name__}")
    return {name: getattr(obj, name) for name in fields}


def _array(value: Any, dtype: str) -> np.ndarray:
    """A numpy array from an ndarray, raw bytes, or a list."""
    if value is None:
        return np.zeros(0, dtype=dtype)
    if isinstance(value, np.ndarray):
        return value.astype(dtype, copy=False)
    if isinstance(value, bytes | bytearray | memoryview):
        return np.frombuffer(value, dtype=dtype)
    if isinstance(value, dict) and "data" in value:  # {"dtype", "shape", "data"} style
        return np.frombuffer(value["data"], dtype=value.get("dtype", dtype)).astype(dtype)
    return np.asarray(value, dtype=dtype)


@dataclass(slots=True)
class RequestView:
    request_id: str
    status: str
    block_table: list[int]
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_computed_tokens: int = 0
    num_generated_tokens: int = 0
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    origin: str = ""  # client_name of the client that sent it ("gui", "http", ...); "" = unknown
    # hybrid KV cache: the sliding groups' tables, -1 where a block left the window
    group_tables: list[list[int]] = field(default_factory=list)
    # agents: the grammar's kind ("" none), tools offered, tokens the grammar allowed per step
    structured: str = ""
    num_tools: int = 0
    allowed_tokens: list[int] = field(default_factory=list)
    # speculative decoding (ipc RequestState): the last speculative step since the previous
    # frame, drafts at positions draft_start.. in draft_blocks (one per slot; [] for none), the
    # first draft_accepted confirmed; and its drafts verified / confirmed so far
    draft_start: int = 0
    draft_blocks: list[int] = field(default_factory=list)
    draft_accepted: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def live_blocks(self) -> list[int]:
        """Every block it holds, in all its groups' tables."""
        return [b for t in (self.block_table, *self.group_tables) for b in t if b >= 0]


# The window's own connection says hello as "gui" and carries both its chats and its load
# generator's requests; the table tells those apart by the generator's request-id prefix.
GUI_ORIGIN = "gui"
HTTP_ORIGIN = "http"


def origin_label(origin: str, request_id: str) -> str:
    """What the request table shows for a request's origin."""
    if origin == GUI_ORIGIN and request_id.startswith(LOAD_ID_PREFIX):
        return "load"
    return origin or "?"


@dataclass(slots=True)
class Frame:
    time: float
    state: np.ndarray  # uint8 [num_blocks]
    ref_count: np.ndarray  # int32
    filled: np.ndarray  # int32
    short_hash: np.ndarray  # uint32
    parent: np.ndarray  # int32
    requests: list[RequestView]
    counters: dict[str, float]
    config: dict[str, Any]
    token_events: list[tuple[str, int, float]] = field(default_factory=list)  # (rid, idx, t)
    steps: list[tuple[float, float, int, int, int, int]] = field(default_factory=list)
    # routed-experts models: tokens routed to each expert, [layer, expert], cumulative since the
    # model was loaded; None for models without experts
    expert_counts: np.ndarray | None = None
    # the CPU decode step and its detail (ipc.telemetry.Telemetry.decode_step); "" for none
    decode_step: str = ""
    decode_detail: str = ""

    @property
    def num_blocks(self) -> int:
        return int(self.state.shape[0])

    @property
    def block_size(self) -> int:
        return int(self.counters.get("block_size", 16) or 16)

    @classmethod
    def from_wire(cls, snap: Any) -> Frame:
        blocks = _get(snap, "blocks", snap)
        if hasattr(blocks, "to_numpy"):  # ipc.protocol.BlockArrays: raw bytes + dtypes
            blocks = blocks.to_numpy()
        reqs = [
            RequestView(
                request_id=str(_get(r, "request_id")),
                status=str(_get(r, "status", "running")),
                block_table=[int(b) for b in (_get(r, "block_table") or [])],
                num_prompt_tokens=int(_get(r, "num_prompt_tokens", 0) or 0),
                num_cached_tokens=int(_get(r, "num_cached_tokens", 0) or 0),
                num_computed_tokens=int(_get(r, "num_computed_tokens", 0) or 0),
                num_generated_tokens=int(_get(r, "num_generated_tokens", 0) or 0),
                arrival_time=float(_get(r, "arrival_time", 0.0) or 0.0),
                first_scheduled_time=_get(r, "first_scheduled_time"),
                first_token_time=_get(r, "first_token_time"),
                origin=str(_get(r, "origin", "") or ""),
                group_tables=[[int(b) for b in t] for t in (_get(r, "group_tables") or [])],
                structured=str(_get(r, "structured", "") or ""),
                num_tools=int(_get(r, "num_tools", 0) or 0),
                allowed_tokens=[int(c) for c in (_get(r, "allowed_tokens") or [])],
                draft_start=int(_get(r, "draft_start", 0) or 0),
                draft_blocks=[int(b) for b in (_get(r, "draft_blocks") or [])],
                draft_accepted=int(_get(r, "draft_accepted", 0) or 0),
                num_draft_tokens=int(_get(r, "num_draft_tokens", 0) or 0),
                num_accepted_tokens=int(_get(r, "num_accepted_tokens", 0) or 0),
            )
            for r in (_get(snap, "requests") or [])
        ]
        events = []
        for e in _get(snap, "token_events") or []:
            if isinstance(e, list | tuple):
                events.append((str(e[0]), int(e[1]), float(e[2])))
            else:
                events.append((str(_get(e, "request_id")), int(_get(e, "index")),
                               float(_get(e, "time"))))
        steps = []
        for s in _get(snap, "steps") or []:
            if isinstance(s, list | tuple):
                steps.append(tuple(s))
            else:
                steps.append((float(_get(s, "time")), float(_get(s, "duration")),
                              int(_get(s, "num_prefill_tokens")), int(_get(s, "num_decode_tokens")),
                              int(_get(s, "num_running")), int(_get(s, "num_waiting"))))
        state = _array(_get(blocks, "state"), "uint8")
        n = state.shape[0]

        def arr(name: str, dtype: str, fill: int) -> np.ndarray:
            a = _array(_get(blocks, name), dtype)
            return a if a.shape[0] == n else np.full(n, fill, dtype=dtype)

        return cls(
            time=float(_get(snap, "time", 0.0) or 0.0),
            state=state,
            ref_count=arr("ref_count", "int32", 0),
            filled=arr("filled", "int32", 0),
            short_hash=arr("short_hash", "uint32", 0),
            parent=arr("parent", "int32", -1),
            requests=reqs,
            counters={str(k): float(v) for k, v in _as_dict(_get(snap, "counters")).items()},
            config=_as_dict(_get(snap, "config")),
            token_events=events,
            steps=steps,
            expert_counts=_expert_counts(_get(snap, "expert_counts")),
            decode_step=str(_get(snap, "decode_step", "") or ""),
            decode_detail=str(_get(snap, "decode_detail", "") or ""),
        )

    def owners(self) -> dict[int, list[str]]:
        """Physical block id -> ids of the live requests whose block table holds it."""
        out: dict[int, list[str]] = {}
        for r in self.requests:
            if r.status == "finished":
                continue
            for b in r.live_blocks():
                out.setdefault(b, []).append(r.request_id)
        return out


def _expert_counts(rows: Any) -> np.ndarray | None:
    """[layer, expert] int64 counts from the wire's list of rows; None when empty or ragged."""
    if not rows:
        return None
    counts = np.asarray(rows, dtype=np.int64) if len({len(r) for r in rows}) == 1 else None
    return counts if counts is not None and counts.ndim == 2 and counts.shape[1] else None


class Ring:
    """Fixed-capacity float64 columns; `view()` returns them oldest first."""

    def __init__(self, capacity: int, columns: int) -> None:
        assert capacity > 0 and columns > 0
        self.capacity = capacity
        self.data = np.zeros((capacity, columns), dtype=np.float64)
        self.n = 0  # total rows ever appended

    def append(self, row: tuple[float, ...] | list[float]) -> None:
        self.data[self.n % self.capacity] = row
        self.n += 1

    def __len__(self) -> int:
        return min(self.n, self.capacity)

    def view(self) -> np.ndarray:
        if self.n <= self.capacity:
            return self.data[: self.n]
        i = self.n % self.capacity
        return np.concatenate((self.data[i:], self.data[:i]))

    def clear(self) -> None:
        self.n = 0


@dataclass(slots=True)
class Rates:
    """Derived numbers for the status line and charts at the latest frame."""

    hit_rate: float = math.nan  # prefix-cache hits / queries over the window (tokens)
    hit_rate_total: float = math.nan  # since the engine started
    tier_hit_rate: float = math.nan  # of those queries, hits loaded from host/disk KV tiers
    prompt_tps: float = 0.0
    gen_tps: float = 0.0
    cached_tps: float = 0.0
    computed_tps: float = 0.0


class History:
    """Everything the charts draw, accumulated from frames; engine clock, seconds since start."""

    # per-frame columns
    T, RUNNING, WAITING, IN_USE, CACHED, EMPTY, OCC, CONTIG, HIT, PTPS, GTPS, CACHED_TPS, \
        COMPUTED_TPS, TIER_HIT = range(14)

    def __init__(self, window_s: float = 10.0, capacity: int = 4096,
                 token_capacity: int = 20000) -> None:
        self.window_s = window_s
        self.frames = Ring(capacity, 14)
        self.itl = Ring(token_capacity, 2)  # (t, seconds between consecutive tokens)
        self.ttft = Ring(1024, 2)  # (t, ttft seconds)
        self.t0: float | None = None
        self.latest: Frame | None = None
        self.rates = Rates()
        self._last_token: dict[str, float] = {}
        self._arrival: dict[str, float] = {}
        self._ttft_seen: dict[str, None] = {}  # insertion-ordered set, bounded
        # (time, prompt, generation, queries, hits, hits from lower tiers or NaN: no tiers)
        self._counter_hist: deque[tuple[float, ...]] = deque()
        # remembered block tables of finished requests, to highlight their cached blocks
        self.last_tables: dict[str, tuple[list[int], list[int]]] = {}
        self.spec = SpecHistory(capacity)  # speculative decoding's acceptance, per interval

    def clear(self) -> None:
        self.__init__(self.window_s, self.frames.capacity, self.itl.capacity)

    def add(self, f: Frame) -> None:
        if self.t0 is None or (self.latest is not None and f.time < self.latest.time):
            # first frame, or an engine restart (new monotonic clock): start over
            self.clear()
            self.t0 = f.time
        self.latest = f
        t = f.time - self.t0
        for r in f.requests:
            self._arrival[r.request_id] = r.arrival_time
            if r.block_table:
                table = np.asarray(r.block_table)
                valid = (table >= 0) & (table < f.num_blocks)
                hashes = np.zeros(len(table), dtype=np.int64)
                hashes[valid] = f.short_hash[table[valid]]
                self.last_tables[r.request_id] = (r.block_table, hashes.tolist())
        if len(self.last_tables) > 512:  # forget the oldest
            for k in list(self.last_tables)[: len(self.last_tables) - 512]:
                del self.last_tables[k]
        self._add_tokens(f)
        self.spec.add(f, t)
        c = f.counters
        self._counter_hist.append((
            f.time,
            c.get("prompt_tokens_total", 0.0),
            c.get("generation_tokens_total", 0.0),
            c.get("prefix_cache_queries", 0.0),
            c.get("prefix_cache_hits", 0.0),
            c.get("external_prefix_cache_hits", math.nan),
        ))
        while len(self._counter_hist) > 2 and f.time - self._counter_hist[1][0] >= self.window_s:
            self._counter_hist.popleft()
        self.rates = self._rates()
        n = max(f.num_blocks, 1)

        def share(key: str, state: int) -> float:
            # The engine sends the counts; count the states only for engines that do not.
            v = c.get(key)
            return (float(np.count_nonzero(f.state == state)) if v is None else v) / n

        pool = c.get("kv_pool_bytes", 0.0)
        contig = c.get("contiguous_kv_bytes", 0.0) / pool if pool > 0 else math.nan
        self.frames.append((
            t,
            c.get("num_requests_running", 0.0),
            c.get("num_requests_waiting", 0.0),
            share("num_blocks_in_use", BLOCK_IN_USE),
            share("num_blocks_cached", BLOCK_CACHED),
            share("num_blocks_empty", BLOCK_EMPTY),
            c.get("kv_token_occupancy", math.nan),
            contig,
            self.rates.hit_rate,
            self.rates.prompt_tps,
            self.rates.gen_tps,
            self.rates.cached_tps,
            self.rates.computed_tps,
            self.rates.tier_hit_rate,
        ))

    def _add_tokens(self, f: Frame) -> None:
        assert self.t0 is not None
        for rid, index, when in sorted(f.token_events, key=lambda e: e[2]):
            if index == 0:
                arrival = self._arrival.get(rid)
                if arrival is not None and arrival > 0 and rid not in self._ttft_seen:
                    self.ttft.append((when - self.t0, when - arrival))
                    self._ttft_seen[rid] = None
            else:
                prev = self._last_token.get(rid)
                if prev is not None:
                    self.itl.append((when - self.t0, when - prev))
            self._last_token[rid] = when
        # a first token whose event we missed (e.g. published before we subscribed)
        for r in f.requests:
            if r.first_token_time is not None and r.request_id not in self._ttft_seen \
                    and r.arrival_time > 0:
                self.ttft.append((r.first_token_time - self.t0,
                                  r.first_token_time - r.arrival_time))
                self._ttft_seen[r.request_id] = None
        if len(self._ttft_seen) > 4096:
            for k in list(self._ttft_seen)[:2048]:
                del self._ttft_seen[k]
        if len(self._last_token) > 4096:
            live = {r.request_id for r in f.requests}
            self._last_token = {k: v for k, v in self._last_token.items() if k in live}
            self._arrival = {k: v for k, v in self._arrival.items() if k in live}

    def _rates(self) -> Rates:
        h = self._counter_hist
        q, k = h[-1][3], h[-1][4]
        total = k / q if q > 0 else math.nan
        if len(h) < 2:
            return Rates(hit_rate_total=total)
        (t0, p0, g0, q0, k0, e0), (t1, p1, g1, q1, k1, e1) = h[0], h[-1]
        dt = max(t1 - t0, 1e-6)
        dq, dk = q1 - q0, k1 - k0
        return Rates(
            hit_rate=dk / dq if dq > 0 else math.nan,
            tier_hit_rate=(e1 - e0) / dq if dq > 0 else math.nan,  # NaN without tiers
            hit_rate_total=total,
            prompt_tps=(p1 - p0) / dt,
            gen_tps=(g1 - g0) / dt,
            cached_tps=dk / dt,
            computed_tps=max(dq - dk, 0.0) / dt,
        )
