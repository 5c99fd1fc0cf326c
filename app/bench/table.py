"""The benchmark's table: rows with ratios against the baseline measured in the same run, and
target verdicts (PASS/MISS)."""

from __future__ import annotations

from dataclasses import dataclass

from app.bench.stats import ratio
from app.bench.workloads import STREAMS_DECODE_WEIGHTS, Sizes, streams_level

BASELINE = "hf"
# The targets for N concurrent streams: kvscope's decode tok/s over llama.cpp's
# (N: (bound, note)), checked for the exact arithmetic and for 8-bit activations alike.
STREAMS_TARGETS = {1: (1.2, ""), 16: (2.0, ""), 64: (2.0, "")}

@dataclass(slots=True)
class Row:
    section: str
    metric: str
    value: float | None
    baseline: float | None = None
    baseline_name: str = ""
    ratio: float | None = None
    target: str = ""
    passed: bool | None = None  # None = no target, or not measurable


def check(value: float | None, op: str, bound: float) -> bool | None:
    if value is None:
        return None
    return value >= bound if op == ">=" else value <= bound


def build_rows(summary: dict[str, dict[str, dict]], ceilings: dict | None) -> list[Row]:
    """summary[workload][system] -> table rows with ratios and target verdicts."""
    rows: list[Row] = []

    def get(workload: str, system: str, key: str) -> float | None:
        return summary.get(workload, {}).get(system, {}).get(key)

    def compare(section: str, metric: str, key: str, system: str = "kvscope",
                base: str = BASELINE, op: str = "", bound: float = 0.0,
                lower_is_better: bool = False) -> Row:
        v, b = get(section, system, key), get(section, base, key)
        r = ratio(b, v) if lower_is_better else ratio(v, b)
        target = f"{op} {bound:g}x {base}" if op else ""
        row = Row(section, metric, v, b, base, r, target, check(r, op, bound) if op else None)
        rows.append(row)
        return row

    compare("single", "decode tok/s (1/TPOT)", "decode_tok_s", op=">=", bound=2.0)
    if get("single", "kvscope-int4", "decode_tok_s") is not None:
        compare("single", "decode tok/s, int4 decode weights", "decode_tok_s",
                system="kvscope-int4", op=">=", bound=2.0)
    compare("single", "TTFT p50 s", "ttft_p50", lower_is_better=True)
    for other in ("llamacpp",):
        if get("single", other, "decode_tok_s") is not None:
            compare("single", f"decode tok/s vs {other}", "decode_tok_s", base=other)
    if ceilings and not ceilings.get("error"):
        model = ceilings["model"]
        bw_ceiling = ceilings["read_bw_gbs"] * 1e9 / model["weight_bytes"]
        flop_ceiling = ceilings["fp32_matmul_gflops"] * 1e9 / (2 * model["num_params"])
        if model.get("dtype") in ("bfloat16", "float16"):
            flop_ceiling = ceilings["bf16_matmul_gflops"] * 1e9 / (2 * model["num_params"])
        v = get("single", "kvscope", "decode_tok_s")
        frac = ratio(v, bw_ceiling)
        rows.append(Row("single", "decode / (bandwidth / weight bytes)", v, bw_ceiling,
                        "ceiling", frac, ">= 0.5 of ceiling", check(frac, ">=", 0.5)))
        # The 64-stream target: against the machine's best matmul (fp32 or bf16; the
        # 4-bit decode products run bf16 dot products where the CPU has them).
        v64 = get("streams-64", "kvscope", "decode_tok_s")
        if v64 is not None:
            best_flops = max(ceilings["fp32_matmul_gflops"], ceilings["bf16_matmul_gflops"])
            matmul = best_flops * 1e9 / (2 * model["num_params"])
            frac = ratio(v64, matmul)
            rows.append(Row("streams-64", "decode tok/s / (best FLOP/s / 2P)", v64,
                            matmul, "ceiling", frac, ">= 0.5 of ceiling", check(frac, ">=", 0.5)))
        best = [(get(w, "kvscope", k), w) for w, k in (("prefill", "prefill_tok_s"),
                ("mixed", "total_tok_s"), ("mixed-poisson", "total_tok_s"))]
        best = [b for b in best if b[0] is not None]
        if best:
            top, where = max(best)
            rows.append(Row("ceilings", f"best tok/s ({where}) / (FLOP/s / 2P)", top,
                            flop_ceiling, "ceiling", ratio(top, flop_ceiling)))
    compare("prefill", "prefill tok/s", "prefill_tok_s", op=">=", bound=1.0)
    for w in ("mixed", "mixed-poisson"):
        compare(w, "output tok/s", "output_tok_s", op=">=" if w == "mixed" else "",
                bound=2.0)
        compare(w, "total tok/s", "total_tok_s")
        compare(w, "TTFT p50 s", "ttft_p50", lower_is_better=True)
        compare(w, "TPOT p50 s", "tpot_p50", lower_is_better=True)
        compare(w, "E2E p50 s", "e2e_p50", lower_is_better=True)
    compare("shared-prefix", "TTFT p50 s (cache vs nocache)", "ttft_p50", base="kvscope-nocache",
            op=">=", bound=8.0, lower_is_better=True)
    hit = get("shared-prefix", "kvscope", "hits_of_shareable")
    rows.append(Row("shared-prefix", "hits / shareable prompt tokens", hit, target=">= 0.9",
                    passed=check(hit, ">=", 0.9)))
    for system in ("kvscope", "kvscope-nochunk"):
        v = get("interference", system, "itl_p99_over_median")
        chunked = system == "kvscope"
        rows.append(Row("interference", f"ITL p99 during long / median ({system})", v,
                        target="<= 3" if chunked else "",
                        passed=check(v, "<=", 3.0) if chunked else None))
    for key, label in (("paged_token_occupancy", "paged KV token occupancy"),
                       ("paged_occupancy_ideal", "paged occupancy ideal for these lengths"),
                       ("contiguous_max_len_occupancy", "contiguous (max_model_len) occupancy"),
                       ("contiguous_per_request_occupancy", "contiguous (prompt+max) occupancy")):
        v = get("mixed", "kvscope", key)
        paged = key == "paged_token_occupancy"
        rows.append(Row("kv", label, v, target=">= 0.95" if paged else "",
                        passed=check(v, ">=", 0.95) if paged else None))
    n = get("streaming", "kvscope-http", "streams") or get("streaming", "kvscope-zmq", "streams")
    streams = f"{n:g} streams" if n else "streams"
    http, zmq = "kvscope-http", "kvscope-zmq"
    compare("streaming", f"HTTP streaming, {streams}: output tok/s vs ZeroMQ", "output_tok_s",
            system=http, base=zmq, op=">=", bound=0.9)
    compare("streaming", "HTTP vs ZeroMQ: TTFT p50 s", "ttft_p50", system=http, base=zmq,
            lower_is_better=True)
    compare("streaming", "HTTP vs ZeroMQ: ITL p50 s", "itl_p50", system=http, base=zmq,
            lower_is_better=True)
    compare("streaming", "HTTP vs ZeroMQ: server+client CPU ms / token",
            "frontend_cpu_ms_per_token", system=http, base=zmq, lower_is_better=True)
    compare("streaming", "HTTP vs ZeroMQ: engine CPU s / wall s", "engine_cpu_share",
            system=http, base=zmq)
    # Workloads that were not run leave no rows (the kv rows come from the mixed run).
    keep = set(summary) | {"ceilings"} | ({"kv"} if "mixed" in summary else set())
    return [r for r in rows if r.section in keep]


@dataclass(slots=True)
class StreamsRow:
    """One concurrency level of the streams-N workloads: decode tok/s of each system."""

    streams: int
    kvscope: float | None
    llamacpp: float | None
    hf: float | None
    vs_llamacpp: float | None
    vs_hf: float | None
    target: str = ""
    passed: bool | None = None
    # kvscope-exact: decode_activations="exact" (float32 activations) beside kvscope's "auto"
    exact: float | None = None
    exact_vs_llamacpp: float | None = None
    exact_passed: bool | None = None


def build_streams_rows(summary: dict[str, dict[str, dict]]) -> list[StreamsRow]:
    """summary[streams-N][system]["decode_tok_s"] -> one row per N, in increasing N."""
    rows = []
    for w in sorted((w for w in summary if streams_level(w)), key=streams_level):
        n = streams_level(w)
        assert n is not None
        tok_s = {system: summary[w].get(system, {}).get("decode_tok_s")
                 for system in ("kvscope", "llamacpp", "hf", "kvscope-exact")}
        vs_llamacpp = ratio(tok_s["kvscope"], tok_s["llamacpp"])
        exact_vs = ratio(tok_s["kvscope-exact"], tok_s["llamacpp"])
        row = StreamsRow(n, tok_s["kvscope"], tok_s["llamacpp"], tok_s["hf"], vs_llamacpp,
                         ratio(tok_s["kvscope"], tok_s["hf"]), exact=tok_s["kvscope-exact"],
                         exact_vs_llamacpp=exact_vs)  # fmt: skip
        if n in STREAMS_TARGETS:
            bound, note = STREAMS_TARGETS[n]
            row.target = f">= {bound:g}x llama.cpp" + (f" ({note})" if note else "")
            row.passed = check(vs_llamacpp, ">=", bound)
            row.exact_passed = check(exact_vs, ">=", bound)
        rows.append(row)
    return rows


def streams_header(summary: dict[str, dict[str, dict]], sizes: Sizes) -> str:
    """The streams table's header: the workload, and what kvscope decoded with."""
    weights = sorted({s["decode_weights"] for w, by in summary.items() if w.startswith("streams-")
                      for s in by.values() if s.get("decode_weights")})
    steps = {s.get("decode_step") for w, by in summary.items() if w.startswith("streams-")
             for s in by.values()}  # fmt: skip
    kv_types = sorted({s["kv_cache_dtype"] for w, by in summary.items()
                       if w.startswith("streams-") for s in by.values() if s.get("kv_cache_dtype")})
    kv = f", KV cache {'/'.join(kv_types)}" if kv_types else ""
    # the fused step's kernel per system ("+int8": 8-bit activations in every step)
    detail = {system: s["decode_detail"] for w, by in summary.items() if w.startswith("streams-")
              for system, s in by.items() if s.get("decode_detail")}  # fmt: skip
    kernels = "; ".join(f"{system} {d}" for system, d in sorted(detail.items()))
    kv += f"; fused step: {kernels}" if kernels else ""
    used = "/".join(weights) if weights else "not measured"
    if "int4" in weights and "fused" in steps:  # engine_proc/executor/fused_decode.py
        used += (" with the fused C++ decode step (every decode step, up to 64 rows per call; "
                 "prompts run the dense weights)")
    elif "int4" in weights:  # engine_proc/models/int4.py MAX_ROWS
        used += (" (4-bit products in steps of at most 16 tokens; larger steps, such as the "
                 "64-stream decode, run the dense weights)")
    return (f"streams: N concurrent greedy streams, all at t=0, {sizes.streams_len}-token "
            f"prompts, {sizes.streams_new} new tokens each (EOS ignored); decode tok/s = tokens "
            f"after each stream's first / (last token - first first token), all streams "
            f"together; kvscope decode weights {STREAMS_DECODE_WEIGHTS} (the app's CPU default) "
            f"-> {used}{kv}; llama.cpp: batched llama_decode, one KV stream per sequence; "
            f"transformers: one static batch of N")


def format_streams_table(rows: list[StreamsRow]) -> str:
    """kvscope's columns (the app's arithmetic), then kvscope-exact's where it ran."""
    exact = any(r.exact is not None for r in rows)
    head = ("streams", "kvscope tok/s", "llama.cpp tok/s", "transformers tok/s",
            "vs llama.cpp", "vs transformers", "target", "",
            *(("exact tok/s", "exact vs llama.cpp", "") if exact else ()))
    body = [(str(r.streams), _fmt(r.kvscope), _fmt(r.llamacpp), _fmt(r.hf), _times(r.vs_llamacpp),
             _times(r.vs_hf), r.target, _verdict(r.passed),
             *((_fmt(r.exact), _times(r.exact_vs_llamacpp), _verdict(r.exact_passed))
               if exact else ()))
            for r in rows]  # fmt: skip
    return _columns(head, body)


def _times(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _verdict(passed: bool | None) -> str:
    return "" if passed is None else ("PASS" if passed else "MISS")


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if x == 0 or 0.01 <= abs(x) < 100000:
        return f"{x:.3g}" if abs(x) < 1 else f"{x:,.2f}" if abs(x) < 100 else f"{x:,.0f}"
    return f"{x:.3g}"


def format_table(rows: list[Row]) -> str:
    head = ("workload", "metric", "kvscope", "baseline", "base", "ratio", "target", "")
    body = [(r.section, r.metric, _fmt(r.value), _fmt(r.baseline), r.baseline_name,
             "-" if r.ratio is None else f"{r.ratio:.2f}x", r.target,
             "" if r.passed is None else ("PASS" if r.passed else "MISS")) for r in rows]
    return _columns(head, body)


def _columns(head: tuple[str, ...], body: list[tuple[str, ...]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(head, *body, strict=True)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
             for line in (head, *body)]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)

