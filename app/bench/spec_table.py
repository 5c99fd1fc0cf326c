"""The spec workloads' table: decode tok/s of each system per workload, stream count and prompt
kind, with ratios from the same run (kvscope-spec over kvscope, over llama.cpp's prompt lookup,
and llama.cpp's own lookup gain), kvscope-spec's acceptance and whether its tokens equal
kvscope's. Targets (issue 35): n-gram speculation >= 2x without it at 1 stream, and never
slower (>= 1x) at 16, where the engine turns drafts off by itself."""

from __future__ import annotations

from dataclasses import dataclass, field

from app.bench.spec_workloads import (
    NGRAM_CONFIG,
    NO_BATCHED_LOOKUP,
    NO_DRAFT_PEER,
    SPEC_KINDS,
    spec_level,
)
from app.bench.stats import ratio
from app.bench.table import _columns, _fmt, check

SPEC_SYSTEMS = ("kvscope", "kvscope-spec", "llamacpp", "llamacpp-lookup")
# (family, N) -> the bound of kvscope-spec over kvscope, on the "all" row.
SPEC_TARGETS = {("spec-ngram", 1): 2.0, ("spec-ngram", 16): 1.0}


@dataclass(slots=True)
class SpecRow:
    workload: str  # the family: spec-ngram | spec-draft
    streams: int
    kind: str  # "all" or a prompt kind
    tok_s: dict[str, float | None] = field(default_factory=dict)
    vs_kvscope: float | None = None  # kvscope-spec / kvscope
    vs_lookup: float | None = None  # kvscope-spec / llamacpp-lookup
    lookup_gain: float | None = None  # llamacpp-lookup / llamacpp
    acceptance: float | None = None  # kvscope-spec's accepted / drafted tokens
    exact: bool | None = None  # kvscope-spec's tokens == kvscope's
    peer_na: str = ""  # why llama.cpp has no speculating peer here
    target: str = ""
    passed: bool | None = None


def peer_na(family: str, streams: int) -> str:
    if family == "spec-draft":
        return NO_DRAFT_PEER
    return NO_BATCHED_LOOKUP if streams > 1 else ""


def _tok_s(s: dict, kind: str) -> float | None:
    if kind == "all":
        return s.get("decode_tok_s")
    return (s.get("decode_tok_s_by_kind") or {}).get(kind)


def build_spec_rows(summary: dict[str, dict[str, dict]],
                    exact: dict[str, dict[str, dict[str, bool | None]]]) -> list[SpecRow]:
    """summary[spec-*-N][system] (app/bench/spec_stats.py) and exact[workload] (its
    `exactness`) -> an "all" row and one row per prompt kind for each workload run."""
    rows = []
    for w in sorted((w for w in summary if spec_level(w)), key=spec_level):
        level = spec_level(w)
        assert level is not None
        family, n = level
        by = summary[w]
        for kind in ("all", *SPEC_KINDS[family]):
            tok_s = {system: _tok_s(by.get(system, {}), kind) for system in SPEC_SYSTEMS}
            row = SpecRow(family, n, kind, tok_s,
                          vs_kvscope=ratio(tok_s["kvscope-spec"], tok_s["kvscope"]),
                          vs_lookup=ratio(tok_s["kvscope-spec"], tok_s["llamacpp-lookup"]),
                          lookup_gain=ratio(tok_s["llamacpp-lookup"], tok_s["llamacpp"]),
                          exact=exact.get(w, {}).get("kvscope-spec", {}).get(kind),
                          peer_na=peer_na(family, n))
            if kind == "all":
                row.acceptance = by.get("kvscope-spec", {}).get("acceptance")
                bound = SPEC_TARGETS.get((family, n))
                if bound is not None:
                    row.target = f">= {bound:g}x kvscope"
                    row.passed = check(row.vs_kvscope, ">=", bound)
            rows.append(row)
    return rows


def _x(r: float | None, na: str = "") -> str:
    return "n/a" if na else "-" if r is None else f"{r:.2f}x"


def format_spec_table(rows: list[SpecRow]) -> str:
    head = ("workload", "streams", "prompt", "kvscope", "kvscope-spec", "llama.cpp",
            "llama.cpp-lookup", "spec/kvscope", "spec/lookup", "lookup/llama.cpp", "accepted",
            "spec exact", "target", "")
    body = []
    for r in rows:
        na = r.peer_na
        body.append((
            r.workload, str(r.streams), r.kind, _fmt(r.tok_s["kvscope"]),
            _fmt(r.tok_s["kvscope-spec"]), _fmt(r.tok_s["llamacpp"]),
            "n/a" if na else _fmt(r.tok_s["llamacpp-lookup"]), _x(r.vs_kvscope),
            _x(r.vs_lookup, na), _x(r.lookup_gain, na),
            "-" if r.acceptance is None else f"{r.acceptance:.0%}",
            "-" if r.exact is None else ("same" if r.exact else "DIFFERS"), r.target,
            "" if r.passed is None else ("PASS" if r.passed else "MISS")))
    notes = sorted({f"  {r.workload}-{r.streams}: {r.peer_na}" for r in rows if r.peer_na})
    return "\n".join([_columns(head, body), *notes])


def spec_header(new_tokens: int) -> str:
    return (
        "spec-ngram / spec-draft: greedy chat prompts whose answer repeats the input (kinds "
        f"quote, edit-code; spec-draft adds free), up to {new_tokens} new tokens each (ends at "
        "end of turn); 1 stream = one request of each kind in turn, N = N at once; decode tok/s "
        "= tokens after each request's first / time some request was decoding. kvscope-spec: "
        f"{NGRAM_CONFIG} (the engine's default disable_by_batch_size) or the --draft-model; "
        "llama.cpp: batched llama_decode; llama.cpp-lookup: llama_cpp.Llama with "
        "LlamaPromptLookupDecoding (high-level API, one sequence); accepted = kvscope-spec's "
        "accepted / drafted tokens; spec exact: its tokens equal kvscope's")
