"""The spec workloads' statistics (pure python): decode tok/s over the decode windows (overall
and per prompt kind), kvscope-spec's draft acceptance, and whether a speculating system's greedy
tokens equal those of the same system without speculation (speculation must be exact)."""

from __future__ import annotations

import statistics
from typing import Any

from app.bench.spec_workloads import spec_level

# A speculating system and the same system without speculation, whose tokens it must equal.
EXACT_PAIRS = {"kvscope-spec": "kvscope", "llamacpp-lookup": "llamacpp"}


def covered(windows: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of [start, end] windows."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(windows):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def decode_tok_s(requests: list[dict]) -> float | None:
    """The tokens after each request's first, over the time some request was decoding (the
    union of [first token, last token] windows): N concurrent streams -> the streams-N measure,
    requests one after another -> their decode time only (the next prompt's prefill is out)."""
    times = [q["token_times"] for q in requests if q.get("token_times")]
    decoded = sum(len(t) - 1 for t in times)
    window = covered([(t[0], t[-1]) for t in times])
    return decoded / window if decoded and window > 0 else None


def _kind(request_id: str) -> str:
    # Request ids are `<kind>-<i>` (spec_workloads.build_spec); kinds contain dashes.
    return request_id.rsplit("-", 1)[0]


def summarize_spec(name: str, ok: list[dict], workload: dict) -> dict[str, Any]:
    """The spec workloads' part of a system's summary: medians over repeats."""
    if spec_level(name) is None:
        return {}
    kinds = workload.get("meta", {}).get("kinds") or []
    out: dict[str, Any] = {"streams": spec_level(name)[1]}

    def median(values: list[float | None]) -> float | None:
        xs = [v for v in values if v is not None]
        return statistics.median(xs) if xs else None

    out["decode_tok_s"] = median([decode_tok_s(r.get("requests", [])) for r in ok])
    out["decode_tok_s_by_kind"] = {
        kind: median([decode_tok_s([q for q in r.get("requests", []) if _kind(q["id"]) == kind])
                      for r in ok]) for kind in kinds}
    drafted = sum((r.get("spec_decode") or {}).get("num_draft_tokens", 0) for r in ok)
    accepted = sum((r.get("spec_decode") or {}).get("num_accepted_tokens", 0) for r in ok)
    if any("spec_decode" in r for r in ok):
        out["spec_draft_tokens"] = drafted
        out["spec_accepted_tokens"] = accepted
        out["acceptance"] = accepted / drafted if drafted else None
    return out


def _tokens(run: dict) -> dict[str, list[int]] | None:
    reqs = run.get("requests")
    if "error" in run or "skipped" in run or not reqs:
        return None
    if any(q.get("token_ids") is None for q in reqs):
        return None
    return {q["id"]: q["token_ids"] for q in reqs}


def exactness(runs: dict[str, list[dict]]) -> dict[str, dict[str, bool | None]]:
    """system -> {"all" | kind: whether every repeat's greedy tokens equal those of the same
    system without speculation (EXACT_PAIRS), repeat by repeat}; None where either side has
    no tokens (failed, skipped, or a runner that does not see ids)."""
    out: dict[str, dict[str, bool | None]] = {}
    for system, base in EXACT_PAIRS.items():
        if system not in runs or base not in runs:
            continue
        pairs = [(_tokens(a), _tokens(b)) for a, b in zip(runs[system], runs[base], strict=False)]
        pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
        if not pairs:
            out[system] = {"all": None}
            continue
        same: dict[str, bool] = {}
        for a, b in pairs:
            for rid in a.keys() | b.keys():
                for key in ("all", _kind(rid)):
                    same[key] = same.get(key, True) and a.get(rid) == b.get(rid)
        out[system] = dict(same)
    return out
