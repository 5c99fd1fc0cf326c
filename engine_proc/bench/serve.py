"""The benchmark's serving loop over an in-process LLMEngine: issue the workload's requests as
they arrive, step the engine, record each request's tokens and times, sample KV occupancy.

Used by engine_proc/bench/kvscope.py (the kvscope systems). Times are `time.monotonic()` seconds.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine_proc.bench.common import Issuer, Req

SNAPSHOT_EVERY = 4  # engine steps between KV occupancy samples


@dataclass(slots=True)
class Served:
    steps: int = 0
    peak_concurrent: int = 0  # most sequences that produced a token in one step


@dataclass(slots=True)
class Occupancy:
    """KV bytes summed over the samples: what the paged pool held, and what contiguous
    allocators would have reserved for the same running requests."""

    filled_bytes: float = 0.0
    paged_bytes: float = 0.0
    contiguous_bytes: float = 0.0
    contiguous_need_bytes: float = 0.0
    samples: int = 0

    def sample(self, engine: Any, active: dict[str, Req], kv_bpt: int) -> None:
        c = engine.snapshot().counters
        in_use = c["kv_bytes_in_use"]
        if not in_use:
            return
        self.samples += 1
        self.filled_bytes += c["kv_token_occupancy"] * in_use
        self.paged_bytes += in_use
        # vLLM paper's baseline reserves max_model_len per request; a kinder contiguous
        # allocator reserves each request's own prompt + max_tokens. Both are reported.
        self.contiguous_bytes += c["contiguous_kv_bytes"]
        self.contiguous_need_bytes += kv_bpt * sum(
            len(r.prompt) + r.max_tokens for r in active.values()
        )

    def result(self) -> dict:
        def ratio(total: float) -> float | None:
            return self.filled_bytes / total if total else None

        n = self.samples
        return {
            "samples": n,
            "paged_token_occupancy": ratio(self.paged_bytes),
            "contiguous_max_len_occupancy": ratio(self.contiguous_bytes),
            "contiguous_per_request_occupancy": ratio(self.contiguous_need_bytes),
            "mean_paged_bytes": self.paged_bytes / n if n else 0.0,
            "mean_contiguous_bytes": self.contiguous_bytes / n if n else 0.0,
        }


def drop_page_cache(directory: str | Path) -> int:
    """Ask the OS to forget the cached pages of every file in `directory` (clean pages only:
    the disk tier fsyncs what it writes), so the next reads come from the device, as after a
    reboot or under memory pressure. Returns the number of files; 0 where there is no
    posix_fadvise."""
    if not hasattr(os, "posix_fadvise"):
        return 0
    n = 0
    for entry in os.scandir(directory):
        if not entry.is_file():
            continue
        try:
            fd = os.open(entry.path, os.O_RDONLY)
        except OSError:  # removed meanwhile
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += 1
        finally:
            os.close(fd)
    return n


def serve(engine: Any, reqs: list[Req], occ: Occupancy,
          when_idle: Callable[[], object] | None = None) -> tuple[float, Served]:
    """Run `reqs` to completion on `engine` (greedy or seeded, EOS ignored unless a request
    says otherwise); returns the start
    time the requests' arrivals are relative to, and step counts. `when_idle` runs whenever no
    request is active, before the next ones are issued (outside every request's TTFT)."""
    from engine_proc import SamplingParams

    clock = engine.clock
    by_id = {r.id: r for r in reqs}
    kv_bpt = engine.kv_bytes_per_token
    active: dict[str, Req] = {}
    served = Served()
    t0 = clock()
    issuer = Issuer(reqs, t0)
    while issuer.pending or active:
        if when_idle is not None and not active:
            when_idle()
        for r in issuer.due(clock()):
            params = SamplingParams(max_tokens=r.max_tokens, temperature=r.temperature,
                                    seed=r.seed, ignore_eos=r.ignore_eos)
            engine.add_request(r.id, r.prompt, params)
            active[r.id] = r
        if not active:
            issuer.wait_for_next(clock)
            continue
        outputs = engine.step()
        served.peak_concurrent = max(served.peak_concurrent, len(outputs))
        for out in outputs:
            r = by_id[out.request_id]
            r.num_out = len(out.token_ids)
            r.num_cached = out.num_cached_tokens
            if out.finished:
                assert out.metrics is not None
                r.token_times = list(out.metrics.token_times)
                r.token_ids = list(out.token_ids)
                r.finished = True
                del active[r.id]
        served.steps += 1
        if served.steps % SNAPSHOT_EVERY == 0:
            occ.sample(engine, active, kv_bpt)
    return t0, served
