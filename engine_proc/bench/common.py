"""What every benchmark runner shares: the workload JSON parsed into requests, the clock that
issues them (timed arrivals and event-triggered ones), the per-request results every system
reports in the same shape, and where the model is.

The runners: engine_proc.bench.worker (kvscope, ceilings, the CLI), engine_proc.bench.hf
(transformers), engine_proc.bench.llamacpp (llama.cpp). Times are `time.monotonic()` seconds.
"""

from __future__ import annotations

import hashlib
import resource
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

WARMUP_PROMPT = list(range(100, 132))  # 32 ordinary token ids of any Llama-family vocabulary
WARMUP_TOKENS = 4


@dataclass(slots=True)
class Req:
    id: str
    prompt: list[int]
    max_tokens: int
    arrival_s: float | None  # relative to the run start; None = event-triggered
    after: dict | None  # {"request": id, "tokens": n}, n = -1: when that request finished
    temperature: float = 0.0  # 0 = greedy (every workload app.bench writes today)
    seed: int | None = None  # of a sampled request's random stream
    # False: the request ends at the model's end-of-generation token, as a chat does (the spec
    # workloads, whose answers end where the repetition ends); every other workload ignores it.
    ignore_eos: bool = True
    issued: float | None = None  # absolute monotonic time the request entered the system
    token_times: list[float] = field(default_factory=list)  # absolute
    token_ids: list[int] | None = None  # when the runner sees them
    num_out: int = 0
    finished: bool = False
    num_cached: int = 0


def parse_workload(raw: dict) -> list[Req]:
    reqs = raw.get("requests")
    if not isinstance(reqs, list) or not reqs:
        raise ValueError("workload.requests must be a non-empty list")
    out = []
    ids = set()
    for i, r in enumerate(reqs):
        rid = r.get("id")
        if not isinstance(rid, str) or not rid or rid in ids:
            raise ValueError(f"workload.requests[{i}].id must be a unique non-empty string")
        ids.add(rid)
        prompt = r.get("prompt")
        if (
            not isinstance(prompt, list)
            or not prompt
            or not all(isinstance(t, int) for t in prompt)
        ):
            raise ValueError(f"workload.requests[{i}].prompt must be a non-empty list of ints")
        max_tokens = r.get("max_tokens")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"workload.requests[{i}].max_tokens must be an int >= 1")
        arrival, after = r.get("arrival_s"), r.get("after")
        if (arrival is None) == (after is None):
            raise ValueError(f"workload.requests[{i}] needs exactly one of arrival_s or after")
        if after is not None and after.get("request") not in ids:
            raise ValueError(f"workload.requests[{i}].after.request must name an earlier request")
        temperature = r.get("temperature", 0.0)
        if not isinstance(temperature, int | float) or temperature < 0:
            raise ValueError(f"workload.requests[{i}].temperature must be a number >= 0")
        seed = r.get("seed")
        if seed is not None and not isinstance(seed, int):
            raise ValueError(f"workload.requests[{i}].seed must be an int")
        ignore_eos = r.get("ignore_eos", True)
        if not isinstance(ignore_eos, bool):
            raise ValueError(f"workload.requests[{i}].ignore_eos must be true or false")
        out.append(Req(rid, prompt, max_tokens, arrival, after, float(temperature), seed,
                       ignore_eos))
    return out


class Issuer:
    """Decides which requests have arrived: timed ones by the clock, event ones by progress."""

    def __init__(self, reqs: list[Req], t0: float) -> None:
        self.t0 = t0
        self.by_id = {r.id: r for r in reqs}
        self.pending = list(reqs)

    def due(self, now: float) -> list[Req]:
        ready = []
        for r in self.pending:
            if r.arrival_s is not None:
                if self.t0 + r.arrival_s <= now:
                    r.issued = self.t0 + r.arrival_s  # it waited since then, whatever we did
                    ready.append(r)
            else:
                ref = self.by_id[r.after["request"]]
                n = r.after["tokens"]
                if ref.finished if n < 0 else ref.num_out >= n:
                    r.issued = now
                    ready.append(r)
        for r in ready:
            self.pending.remove(r)
        return ready

    def next_time(self) -> float | None:
        times = [self.t0 + r.arrival_s for r in self.pending if r.arrival_s is not None]
        return min(times) if times else None

    def wait_for_next(self, clock: Callable[[], float]) -> None:
        """Nothing is due and nothing runs: sleep until the next timed arrival."""
        nxt = self.next_time()
        if nxt is None:
            raise ValueError("workload has event-triggered requests that can never arrive")
        time.sleep(max(0.0, nxt - clock()))


def arrived_batches(issuer: Issuer, clock: Callable[[], float], size: int) -> Iterator[list[Req]]:
    """Requests in arrival order, up to `size` at a time, waiting for the next arrival when
    none is due (static batching: a batch never grows once started)."""
    queue: list[Req] = []
    while issuer.pending or queue:
        queue.extend(issuer.due(clock()))
        if not queue:
            issuer.wait_for_next(clock)
            continue
        batch, queue = queue[:size], queue[size:]
        yield batch


def request_results(reqs: list[Req], t0: float) -> list[dict]:
    rows = []
    for r in reqs:
        t = r.token_times
        ttft = t[0] - r.issued if t and r.issued is not None else None
        itl = [b - a for a, b in zip(t, t[1:], strict=False)]
        row = {
            "id": r.id,
            "prompt_tokens": len(r.prompt),
            "output_tokens": len(t),
            "cached_tokens": r.num_cached,
            "arrival": None if r.issued is None else r.issued - t0,
            "ttft": ttft,
            "tpot": (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None,
            "e2e": t[-1] - r.issued if t and r.issued is not None else None,
            "itl": [round(x, 6) for x in itl],
            "token_times": [round(x - t0, 6) for x in t],
        }
        if r.token_ids is not None:
            row["token_ids"] = list(r.token_ids)
        rows.append(row)
    return rows


def summarize(reqs: list[Req], t0: float) -> dict:
    ends = [r.token_times[-1] for r in reqs if r.token_times]
    wall = (max(ends) - t0) if ends else 0.0
    out_tokens = sum(len(r.token_times) for r in reqs)
    prompt_tokens = sum(len(r.prompt) for r in reqs)
    return {
        "wall_s": wall,
        "num_requests": len(reqs),
        "output_tokens": out_tokens,
        "prompt_tokens": prompt_tokens,
        "output_tok_s": out_tokens / wall if wall > 0 else None,
        "total_tok_s": (out_tokens + prompt_tokens) / wall if wall > 0 else None,
    }


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


# --------------------------------------------------------------------------------------------
# The model


def model_path(model: str | None) -> Path:
    from engine_proc.loading.loader import default_model_path

    return default_model_path() if model is None else Path(model).expanduser().resolve()


def cache_key(path: Path, dtype: str, tag: str) -> str:
    """Directory name of a dequantized-weights cache entry: file, size, mtime, dtype and the
    loader's own version (the newest mtime of the modules that turn a file into weights)."""
    st = path.stat()
    loading = Path(__file__).parent.parent / "loading"  # engine_proc/loading/
    loader = max(module.stat().st_mtime_ns for module in loading.glob("*.py"))
    raw = f"{tag}|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{dtype}|{loader}"
    return f"{tag}-{hashlib.sha256(raw.encode()).hexdigest()[:16]}"
