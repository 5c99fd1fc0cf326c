"""A fake engine's telemetry, for widget tests and `python -m app --demo`: no engine, no torch.

A toy block pool with prefix sharing, LRU reuse of cached blocks and requests that prefill, decode
and finish, emitting frames shaped like the real ones (dicts with the fields of
engine_proc/engine/telemetry_types.py). It is a picture generator, not a reference implementation.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from ui.telemetry import BLOCK_CACHED, BLOCK_EMPTY, BLOCK_IN_USE


@dataclass(slots=True)
class _Req:
    rid: str
    prompt: int
    max_out: int
    arrival: float
    prefix_key: int  # requests with the same key share their first `shared` prompt tokens
    shared: int
    table: list[int] = field(default_factory=list)
    computed: int = 0
    generated: int = 0
    cached: int = 0
    first_sched: float | None = None
    first_tok: float | None = None
    origin: str = "load"  # the client it came from, as the engine's telemetry names it


class SyntheticEngine:
    def __init__(self, num_blocks: int = 512, block_size: int = 16, seed: int = 0,
                 max_num_seqs: int = 16, chunk: int = 256) -> None:
        self.rng = random.Random(seed)
        self.n = num_blocks
        self.bs = block_size
        self.t = 1000.0
        self.ref = np.zeros(num_blocks, np.int32)
        self.filled = np.zeros(num_blocks, np.int32)
        self.hash = np.zeros(num_blocks, np.uint32)
        self.parent = np.full(num_blocks, -1, np.int32)
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.by_hash: dict[int, int] = {}
        self.running: list[_Req] = []
        self.waiting: list[_Req] = []
        self.counter = 0
        self.c = dict(prompt_tokens_total=0.0, generation_tokens_total=0.0,
                      prefix_cache_queries=0.0, prefix_cache_hits=0.0, num_preemptions=0.0,
                      num_requests_finished=0.0)
        self.config = dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=2048,
                           long_prefill_chunk=chunk, enable_prefix_caching=True)
        self.events: list[tuple[str, int, float]] = []
        self.steps: list[tuple] = []

    # --- requests -------------------------------------------------------------------------
    def add(self, prompt: int | None = None, max_out: int | None = None,
            prefix_key: int | None = None, origin: str = "load") -> str:
        self.counter += 1
        rid = f"req-{self.counter}"
        key = self.rng.randrange(3) if prefix_key is None else prefix_key
        self.waiting.append(_Req(rid, prompt or self.rng.randint(40, 300),
                                 max_out or self.rng.randint(20, 120), self.t, key, 64 + 32 * key,
                                 origin=origin))
        return rid

    def _hash(self, r: _Req, i: int) -> int:
        # blocks fully inside the shared prefix hash the same across requests with one key
        if (i + 1) * self.bs <= r.shared:
            return (r.prefix_key * 7919 + i * 104729 + 1) & 0xFFFFFFFF or 1
        return (hash((r.rid, i)) & 0xFFFFFFFF) or 1

    def _alloc(self) -> int | None:
        if not self.free:
            return None
        b, _ = self.free.popitem(last=False)
        if self.hash[b]:
            self.by_hash.pop(int(self.hash[b]), None)
            self.hash[b] = 0
        self.filled[b] = 0
        self.parent[b] = -1
        return b

    def _admit(self, r: _Req) -> bool:
        if len(self.running) >= int(self.config["max_num_seqs"]):
            return False
        hits = []
        if self.config["enable_prefix_caching"]:
            for i in range((r.prompt - 1) // self.bs):
                b = self.by_hash.get(self._hash(r, i))
                if b is None:
                    break
                hits.append(b)
        if len(self.free) < (r.prompt // self.bs + 2):
            return False
        for b in hits:
            self.ref[b] += 1
            self.free.pop(b, None)
        r.table = hits
        r.cached = r.computed = len(hits) * self.bs
        self.c["prefix_cache_queries"] += r.prompt
        self.c["prefix_cache_hits"] += r.cached
        r.first_sched = self.t
        return True

    def _ensure(self, r: _Req, tokens: int) -> bool:
        while len(r.table) * self.bs < tokens:
            b = self._alloc()
            if b is None:
                return False
            self.ref[b] = 1
            if r.table:
                self.parent[b] = r.table[-1]
            r.table.append(b)
        return True

    def _release(self, r: _Req) -> None:
        for b in reversed(r.table):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None  # tail of the LRU queue
        r.table = []

    # --- one step ---------------------------------------------------------------------------
    def step(self, dt: float = 0.03) -> None:
        self.t += dt
        while self.waiting and self._admit(self.waiting[0]):
            self.running.append(self.waiting.pop(0))
        prefill = decode = 0
        budget = int(self.config["long_prefill_chunk"]) or 2048
        for r in list(self.running):
            total = r.prompt + r.generated
            if r.computed < r.prompt:
                take = min(budget, r.prompt - r.computed)
                prefill += take
                r.computed += take
                self.c["prompt_tokens_total"] += take
            else:
                decode += 1
                r.computed += 1
            if not self._ensure(r, r.computed):
                self.c["num_preemptions"] += 1
                self._release(r)
                r.computed = r.generated = 0
                self.running.remove(r)
                self.waiting.insert(0, r)
                continue
            for i, b in enumerate(r.table):
                self.filled[b] = min(self.bs, max(0, r.computed - i * self.bs))
                if self.filled[b] == self.bs and not self.hash[b] and \
                        self.config["enable_prefix_caching"]:
                    h = self._hash(r, i)
                    if h not in self.by_hash:
                        self.hash[b] = h
                        self.by_hash[h] = b
            if r.computed >= r.prompt:
                if r.first_tok is None:
                    r.first_tok = self.t
                self.events.append((r.rid, r.generated, self.t + self.rng.uniform(0, dt / 4)))
                r.generated += 1
                self.c["generation_tokens_total"] += 1
            if r.generated >= r.max_out and total > 0:
                self._release(r)
                self.running.remove(r)
                self.c["num_requests_finished"] += 1
        self.steps.append((self.t, dt, prefill, decode, len(self.running), len(self.waiting)))

    def flush_prefix_cache(self) -> None:
        for b in list(self.free):
            self.hash[b] = 0
        self.by_hash = {h: b for h, b in self.by_hash.items() if self.ref[b] > 0}

    # --- telemetry --------------------------------------------------------------------------
    def snapshot(self) -> dict:
        state = np.full(self.n, BLOCK_EMPTY, np.uint8)
        state[(self.ref == 0) & (self.hash != 0)] = BLOCK_CACHED
        state[self.ref > 0] = BLOCK_IN_USE
        in_use = int(np.count_nonzero(state == BLOCK_IN_USE))
        bytes_per_block = 46080 * self.bs
        slots = in_use * self.bs
        c = dict(self.c)
        c.update(
            num_requests_running=float(len(self.running)),
            num_requests_waiting=float(len(self.waiting)),
            kv_cache_usage_perc=in_use / self.n,
            num_blocks_total=float(self.n),
            num_blocks_in_use=float(in_use),
            num_blocks_cached=float(np.count_nonzero(state == BLOCK_CACHED)),
            num_blocks_empty=float(np.count_nonzero(state == BLOCK_EMPTY)),
            kv_token_occupancy=float(self.filled[state == BLOCK_IN_USE].sum()) / slots
            if slots else 0.0,
            kv_pool_bytes=float(self.n * bytes_per_block),
            kv_bytes_in_use=float(in_use * bytes_per_block),
            contiguous_kv_bytes=float(len(self.running) * 2048 * 46080),
            block_size=float(self.bs),
        )
        reqs = [
            dict(request_id=r.rid, status=st, block_table=list(r.table),
                 num_prompt_tokens=r.prompt, num_cached_tokens=r.cached,
                 num_computed_tokens=r.computed, num_generated_tokens=r.generated,
                 arrival_time=r.arrival, first_scheduled_time=r.first_sched,
                 first_token_time=r.first_tok, origin=r.origin)
            for st, group in (("running", self.running), ("waiting", self.waiting))
            for r in group
        ]
        snap = dict(
            time=self.t,
            blocks=dict(state=state, ref_count=self.ref.copy(), filled=self.filled.copy(),
                        short_hash=self.hash.copy(), parent=self.parent.copy()),
            requests=reqs, counters=c, config=dict(self.config),
            token_events=self.events, steps=self.steps,
        )
        self.events, self.steps = [], []
        return snap

    def model_info(self) -> dict:
        return dict(name="synthetic (demo)", architecture="llama", num_layers=30,
                    num_kv_heads=3, head_dim=64, dtype="float32", device="cpu",
                    block_size=self.bs, num_blocks=self.n, kv_bytes_per_token=46080,
                    max_model_len=2048)
