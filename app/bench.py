"""`kvscope bench` / `python -m app.bench`: KVScope's engine against transformers (and llama.cpp).

    python -m app.bench --quick              # ~3 min smoke run: every workload, one repeat
    python -m app.bench --repeats 3 --out bench_out

Workloads are built here from a seed (token ids drawn from the model's ordinary vocabulary,
output lengths, arrival times) and written as JSON; each (system, workload, repeat) then runs in
a fresh `python -m engine_proc.bench_worker` process, systems alternating (A B A B ...) so
machine drift hits all of them alike. This module never imports torch, transformers or
engine_proc: everything it knows about the model comes from the `ceilings` worker.

Outputs: a table on stdout (ratios against transformers measured in the same run, targets with
PASS/MISS), `bench.json` and, when matplotlib is installed, PNG plots, all in --out.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from app.supervisor import DTYPES

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = ("single", "prefill", "mixed", "mixed-poisson", "shared-prefix", "interference")
BASELINE = "hf"
# Which systems each workload compares (llamacpp only where it is a like-for-like serving test).
WORKLOAD_SYSTEMS = {
    "single": ("kvscope", "kvscope-int4", "hf", "llamacpp"),
    "prefill": ("kvscope", "hf", "llamacpp"),
    "mixed": ("kvscope", "hf", "llamacpp"),
    "mixed-poisson": ("kvscope", "hf"),
    "shared-prefix": ("kvscope", "kvscope-nocache"),
    "interference": ("kvscope", "kvscope-nochunk"),
}


@dataclass(slots=True)
class Sizes:
    single_prompt: int = 128
    single_new: int = 256
    prefill_len: int = 1000
    prefill_reps: int = 3
    mixed_n: int = 64
    mixed_prompt: tuple[int, int] = (32, 1024)
    mixed_out: tuple[int, int] = (16, 256)
    poisson_rate: float = 1.0  # requests per second
    shared_n: int = 32
    shared_prefix: int = 1024
    shared_user: int = 32
    shared_out: int = 8
    interf_streams: int = 8
    interf_long: int = 2000
    interf_chunk: int = 32  # long_prefill_chunk of the chunked run (CPU-sized, see --help)
    interf_warm: int = 8  # decode tokens each stream has before the long prompt arrives
    interf_tail: int = 8  # decode steps after the long prompt's chunks
    hf_batch: int = 8


FULL = Sizes()
QUICK = Sizes(
    single_prompt=32, single_new=32, prefill_len=256, prefill_reps=2,
    mixed_n=12, mixed_prompt=(16, 64), mixed_out=(4, 16), poisson_rate=4.0,
    shared_n=4, shared_prefix=512, shared_user=16, shared_out=2,
    interf_streams=4, interf_long=256, interf_chunk=32, interf_warm=4, interf_tail=4,
    hf_batch=4,  # three static batches for twelve requests, like 64 requests in batches of 8
)


# --------------------------------------------------------------------------------------------
# Workloads: pure functions of (sizes, seed, vocabulary)


class Vocab:
    """Ordinary token ids: [0, vocab_size) without the special / added ones."""

    def __init__(self, vocab_size: int, special_ids: list[int]) -> None:
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        self.special = set(special_ids)
        self.low = max(self.special) + 1 if self.special else 0
        self.size = vocab_size

    def draw(self, rng: random.Random, n: int) -> list[int]:
        out = []
        while len(out) < n:
            t = rng.randrange(self.low, self.size)
            if t not in self.special:
                out.append(t)
        return out


def _request(rid: str, prompt: list[int], max_tokens: int, **when: Any) -> dict:
    return {"id": rid, "prompt": prompt, "max_tokens": max_tokens, **when}


def make_workload(name: str, sizes: Sizes, seed: int, vocab: Vocab) -> dict:
    """The workload `name` as the JSON the worker reads; same inputs, same output."""
    if name not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {name!r}")
    # One stream per workload name, so changing one workload's sizes leaves the others alone.
    rng = random.Random(f"{seed}:{name}")
    s = sizes
    engine: dict[str, Any] = {}
    meta: dict[str, Any] = {}
    if name == "single":
        reqs = [_request("r0", vocab.draw(rng, s.single_prompt), s.single_new, arrival_s=0.0)]
    elif name == "prefill":
        reqs = [_request(f"p{i}", vocab.draw(rng, s.prefill_len), 1,
                         **({"arrival_s": 0.0} if i == 0 else
                            {"after": {"request": f"p{i - 1}", "tokens": -1}}))
                for i in range(s.prefill_reps)]
    elif name in ("mixed", "mixed-poisson"):
        rng = random.Random(f"{seed}:mixed")  # both variants serve the very same requests
        reqs = [_request(f"m{i}", vocab.draw(rng, rng.randint(*s.mixed_prompt)),
                         rng.randint(*s.mixed_out), arrival_s=0.0) for i in range(s.mixed_n)]
        if name == "mixed-poisson":
            arrivals = random.Random(f"{seed}:arrivals")
            t = 0.0
            for r in reqs:
                r["arrival_s"] = round(t, 6)
                t += arrivals.expovariate(s.poisson_rate)
            meta["rate"] = s.poisson_rate
    elif name == "shared-prefix":
        prefix = vocab.draw(rng, s.shared_prefix)
        reqs = [_request(f"c{i}", prefix + vocab.draw(rng, s.shared_user), s.shared_out,
                         **({"arrival_s": 0.0} if i == 0 else
                            {"after": {"request": f"c{i - 1}", "tokens": -1}}))
                for i in range(s.shared_n)]
        meta["shared_prefix"] = s.shared_prefix
    else:  # interference
        chunk_steps = -(-s.interf_long // s.interf_chunk)
        decode_len = s.interf_warm + chunk_steps + s.interf_tail
        reqs = [_request(f"d{i}", vocab.draw(rng, 32), decode_len, arrival_s=0.0)
                for i in range(s.interf_streams)]
        reqs.append(_request("long", vocab.draw(rng, s.interf_long), 1,
                             after={"request": "d0", "tokens": s.interf_warm}))
        engine = {"long_prefill_chunk": s.interf_chunk,
                  "max_num_batched_tokens": max(2048, s.interf_chunk + s.interf_streams)}
        meta["long_id"] = "long"
    return {"name": name, "seed": seed, "requests": reqs, "engine": engine,
            "hf_batch": s.hf_batch, "meta": meta}


# --------------------------------------------------------------------------------------------
# Running workers


def run_worker(system: str, workload_path: Path | None, args: argparse.Namespace,
               timeout: float) -> dict:
    cmd = [sys.executable, "-m", "engine_proc.bench_worker", "--system", system,
           "--dtype", args.dtype, "--threads", str(args.threads), "--hf-batch", str(args.hf_batch)]
    if workload_path is not None:
        cmd += ["--workload", str(workload_path)]
    if args.quick:
        cmd.append("--quick")
    if args.model:
        cmd += ["--model", args.model]
    if args.cache_dir:
        cmd += ["--cache-dir", args.cache_dir]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                              cwd=REPO_ROOT)
    except subprocess.TimeoutExpired:
        return {"system": system, "error": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or "").strip().splitlines()[-5:]
        return {"system": system, "error": f"exit {proc.returncode}: " + " | ".join(tail)}
    result = json.loads(lines[-1])
    result["spawn_s"] = time.monotonic() - start
    return result


def resolve_threads(requested: int | None) -> int:
    """All cores on an idle machine, one on a busy one: with two OpenMP threads on a loaded
    2-core box every parallel region waits for a descheduled thread (steps 100x slower)."""
    if requested:
        return requested
    cores = os.cpu_count() or 1
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return cores if load < 0.5 * cores else 1


# --------------------------------------------------------------------------------------------
# Statistics (pure python)


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile, q in [0, 100] (numpy's default method)."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def median_of(runs: list[dict], key: str) -> float | None:
    vals = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def pooled(runs: list[dict], key: str) -> list[float]:
    return [q[key] for r in runs for q in r.get("requests", []) if q.get(key) is not None]


def interference_stats(run: dict, long_id: str = "long") -> dict:
    """Decode ITLs of the streams that end while the long prompt is being prefilled, against
    the median ITL of those streams over the whole run."""
    reqs = {q["id"]: q for q in run["requests"]}
    long = reqs[long_id]
    start, end = long["arrival"], long["token_times"][0]
    during, all_itl = [], []
    for q in reqs.values():
        if q["id"] == long_id:
            continue
        t = q["token_times"]
        for a, b in zip(t, t[1:], strict=False):
            all_itl.append(b - a)
            if start < b <= end + 1e-9:
                during.append(b - a)
    med = percentile(all_itl, 50)
    p99 = percentile(during, 99)
    return {"itl_p99_during": p99, "itl_median": med, "p99_over_median": ratio(p99, med),
            "window_s": end - start, "itl_during_count": len(during)}


def ideal_paged_occupancy(requests: list[dict], block_size: int) -> float:
    """Filled / allocated slots if every request held exactly ceil(L / block) blocks at each
    length L of its decode: the best paging can do for these lengths (the tail block's waste)."""
    filled = allocated = 0
    for r in requests:
        for length in range(len(r["prompt"]), len(r["prompt"]) + r["max_tokens"]):
            filled += length
            allocated += -(-length // block_size) * block_size
    return filled / allocated


def summarize_workload(name: str, runs: list[dict], workload: dict) -> dict:
    """Median over repeats of the per-run numbers one system produced on one workload."""
    ok = [r for r in runs if "error" not in r and "skipped" not in r]
    if not ok:
        first = runs[0] if runs else {}
        return {"error": first.get("error") or first.get("skipped") or "no runs"}
    s: dict[str, Any] = {
        "runs": len(ok),
        "output_tok_s": median_of(ok, "output_tok_s"),
        "total_tok_s": median_of(ok, "total_tok_s"),
        "wall_s": median_of(ok, "wall_s"),
        "peak_rss_mb": median_of(ok, "peak_rss_mb"),
        "ttft_p50": percentile(pooled(ok, "ttft"), 50),
        "ttft_p99": percentile(pooled(ok, "ttft"), 99),
        "tpot_p50": percentile(pooled(ok, "tpot"), 50),
        "e2e_p50": percentile(pooled(ok, "e2e"), 50),
        "itl_p50": percentile([x for r in ok for q in r["requests"] for x in q["itl"]], 50),
        "itl_p99": percentile([x for r in ok for q in r["requests"] for x in q["itl"]], 99),
        "prefix_hit_rate": median_of(ok, "prefix_hit_rate"),
        "num_preemptions": median_of(ok, "num_preemptions"),
    }
    if name == "single":
        s["decode_tok_s"] = ratio(1.0, s["tpot_p50"])
    if name == "prefill":
        tps = [q["prompt_tokens"] / q["ttft"] for r in ok for q in r["requests"] if q["ttft"]]
        s["prefill_tok_s"] = statistics.median(tps) if tps else None
    if name == "shared-prefix":
        n = len(workload["requests"])
        shareable = (n - 1) * workload["meta"]["shared_prefix"]
        s["hits_of_shareable"] = ratio(median_of(ok, "prefix_cache_hits"), shareable)
        # The first chat can never hit: the steady state is the others'.
        s["ttft_p50_warm"] = percentile(
            [q["ttft"] for r in ok for q in r["requests"][1:] if q["ttft"] is not None], 50)
    if name == "interference":
        per = [interference_stats(r, workload["meta"]["long_id"]) for r in ok]
        s["interference"] = per
        s["itl_p99_over_median"] = statistics.median(
            p["p99_over_median"] for p in per if p["p99_over_median"] is not None)
    kv = [r["kv"] for r in ok if r.get("kv") and r["kv"].get("paged_token_occupancy")]
    block = (ok[0].get("engine_config") or {}).get("block_size")
    if kv and block:
        s["paged_occupancy_ideal"] = ideal_paged_occupancy(workload["requests"], block)
    if kv:
        for key in ("paged_token_occupancy", "contiguous_max_len_occupancy",
                    "contiguous_per_request_occupancy"):
            s[key] = statistics.median(k[key] for k in kv if k[key] is not None)
    return s


# --------------------------------------------------------------------------------------------
# The table


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
        best = [(get(w, "kvscope", k), w) for w, k in (("prefill", "prefill_tok_s"),
                ("mixed", "total_tok_s"), ("mixed-poisson", "total_tok_s"))]
        best = [b for b in best if b[0] is not None]
        if best:
            top, where = max(best)
            rows.append(Row("ceilings", f"best tok/s ({where}) / (FLOP/s / 2P)", top,
                            flop_ceiling, "ceiling", ratio(top, flop_ceiling)))
    compare("prefill", "prefill tok/s", "prefill_tok_s", op=">=", bound=0.95)
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
    # Workloads that were not run leave no rows (the kv rows come from the mixed run).
    keep = set(summary) | {"ceilings"} | ({"kv"} if "mixed" in summary else set())
    return [r for r in rows if r.section in keep]


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
    widths = [max(len(str(c)) for c in col) for col in zip(head, *body, strict=True)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
             for line in (head, *body)]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Plots (optional)


def write_plots(out: Path, runs: dict[str, dict[str, list[dict]]],
                summary: dict[str, dict[str, dict]]) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no plots (pip install matplotlib)")
        return []
    written = []
    cols = min(3, len(runs))
    nrows = -(-len(runs) // cols)
    for metric in ("ttft", "itl", "e2e"):
        fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.2 * nrows), squeeze=False)
        flat = [ax for row in axes for ax in row]
        for ax, (workload, by_system) in zip(flat, runs.items(), strict=False):
            lo, hi = math.inf, 0.0
            for system, rs in by_system.items():
                vals = sorted(x for r in rs if "requests" in r for q in r["requests"]
                              for x in (q["itl"] if metric == "itl" else [q[metric]])
                              if x is not None and x > 0)
                if vals:
                    ys = [(i + 1) / len(vals) for i in range(len(vals))]
                    ax.step([0.0, *vals], [0.0, *ys], where="post", label=system)
                    lo, hi = min(lo, vals[0]), max(hi, vals[-1])
            if hi > 10 * lo:
                ax.set_xscale("log")
            ax.set_title(f"{workload}: {metric} CDF", fontsize=9)
            ax.set_xlabel("seconds")
            ax.set_ylim(0, 1.02)
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
        for ax in flat[len(runs):]:
            ax.axis("off")
        fig.tight_layout()
        path = out / f"cdf_{metric}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    fig, ax = plt.subplots(figsize=(8, 3.5))
    labels, values = [], []
    for workload in ("mixed", "mixed-poisson", "prefill"):
        key = "prefill_tok_s" if workload == "prefill" else "output_tok_s"
        for system, s in summary.get(workload, {}).items():
            if s.get(key) is not None:
                labels.append(f"{workload}\n{system}")
                values.append(s[key])
    ax.bar(range(len(values)), values)
    ax.set_xticks(range(len(values)), labels, fontsize=7)
    ax.set_ylabel("tok/s (prefill: prompt, others: output)")
    fig.tight_layout()
    path = out / "throughput.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(path)
    return written


# --------------------------------------------------------------------------------------------
# CLI


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvscope bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="small counts and lengths, one repeat (a few minutes on 2 cores)")
    ap.add_argument("--repeats", type=int, default=None, help="default 3, --quick 1")
    ap.add_argument("--workloads", default=",".join(WORKLOADS),
                    help=f"comma-separated subset of {','.join(WORKLOADS)}")
    ap.add_argument("--systems", default="kvscope,hf,llamacpp",
                    help="which of kvscope,hf,llamacpp to run (the kvscope variants follow "
                    "kvscope)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="GGUF file or HF directory (default SmolLM2)")
    ap.add_argument("--dtype", default="float32", choices=DTYPES)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads for every system (default: all cores when the machine "
                    "is idle, else 1)")
    ap.add_argument("--hf-batch", type=int, default=None, help="transformers static batch size")
    ap.add_argument("--rate", type=float, default=None, help="Poisson arrival rate, req/s")
    ap.add_argument("--interference-chunk", type=int, default=None,
                    help="long_prefill_chunk of the chunked interference run (default 32: on "
                    "a CPU a step costs about its token count, so a chunk must stay within a "
                    "few decode steps' worth of tokens)")
    ap.add_argument("--out", default="bench_out", help="output directory")
    ap.add_argument("--cache-dir", default=None, help="worker dequantized-weights cache")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per worker run")
    ap.add_argument("--log-level", default="INFO")
    return ap


def _sizes(args: argparse.Namespace) -> Sizes:
    s = Sizes(**asdict(QUICK if args.quick else FULL))
    if args.hf_batch:
        s.hf_batch = args.hf_batch
    if args.rate:
        s.poisson_rate = args.rate
    if args.interference_chunk:
        s.interf_chunk = args.interference_chunk
    return s


def _plan(workloads: list[str], systems: list[str]) -> list[tuple[str, str]]:
    plan = []
    for w in workloads:
        for system in WORKLOAD_SYSTEMS[w]:
            family = system.split("-")[0]
            if family in systems:
                plan.append((w, system))
    return plan


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    bad = [w for w in workloads if w not in WORKLOADS]
    if bad:
        print(f"error: --workloads: unknown {bad}; allowed: {', '.join(WORKLOADS)}",
              file=sys.stderr)
        return 2
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if any(s not in ("kvscope", "hf", "llamacpp") for s in systems):
        print("error: --systems must be a subset of kvscope,hf,llamacpp", file=sys.stderr)
        return 2
    sizes = _sizes(args)
    args.hf_batch = sizes.hf_batch
    repeats = args.repeats or (1 if args.quick else 3)
    args.threads = resolve_threads(args.threads)
    timeout = args.timeout or (600.0 if args.quick else 7200.0)
    out = Path(args.out)
    (out / "workloads").mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    log.info("bench: %s, %d repeat(s), %d thread(s), dtype %s, out %s",
             "quick" if args.quick else "full", repeats, args.threads, args.dtype, out)

    log.info("[ceilings] machine ceilings and model facts (first run also caches the weights)")
    ceilings = run_worker("ceilings", None, args, timeout)
    if "error" in ceilings:
        print(f"error: the ceilings worker failed: {ceilings['error']}", file=sys.stderr)
        return 1
    model = ceilings["model"]
    log.info("[ceilings] read %.1f GB/s, fp32 %.1f GFLOP/s, bf16 %.1f GFLOP/s; %s, %.1fM params",
             ceilings["read_bw_gbs"], ceilings["fp32_matmul_gflops"],
             ceilings["bf16_matmul_gflops"], model["name"], model["num_params"] / 1e6)
    vocab = Vocab(model["vocab_size"], model["special_ids"])
    wl_defs, wl_paths = {}, {}
    for w in workloads:
        wl_defs[w] = make_workload(w, sizes, args.seed, vocab)
        wl_paths[w] = out / "workloads" / f"{w}.json"
        wl_paths[w].write_text(json.dumps(wl_defs[w]))

    plan = _plan(workloads, systems)
    runs: dict[str, dict[str, list[dict]]] = {w: {} for w in workloads}
    total = len(plan) * repeats
    done = 0
    for rep in range(repeats):
        for w in workloads:  # per workload: A B (C), repeat after repeat -> A B A B ...
            for ww, system in plan:
                if ww != w:
                    continue
                done += 1
                log.info("[%d/%d] %s: %s (repeat %d/%d) ...", done, total, w, system,
                         rep + 1, repeats)
                if system == "llamacpp" and importlib.util.find_spec("llama_cpp") is None:
                    # What the worker would say, without paying for a process start.
                    result = {"system": system, "skipped": "llama-cpp-python is not installed "
                              "(pip install llama-cpp-python)"}
                else:
                    result = run_worker(system, wl_paths[w], args, timeout)
                runs[w].setdefault(system, []).append(result)
                log.info("[%d/%d] %s: %s -> %s", done, total, w, system, _brief(result))
    summary = {w: {s: summarize_workload(w, rs, wl_defs[w]) for s, rs in by.items()}
               for w, by in runs.items()}
    rows = build_rows(summary, ceilings)
    table = format_table(rows)
    header = (f"KVScope bench ({'quick' if args.quick else 'full'}, {repeats} repeat(s), "
              f"{args.threads} thread(s), {args.dtype}, {model['name']}, hf static batch "
              f"{sizes.hf_batch}, interference chunk {sizes.interf_chunk}); ratio = kvscope "
              f"over baseline (for latencies: baseline over kvscope), medians over repeats")
    print(header)
    print(table)
    skipped = {f"{w}/{s}": r[0].get("skipped") or r[0].get("error")
               for w, by in runs.items() for s, r in by.items()
               if r and ("skipped" in r[0] or "error" in r[0])}
    for key, why in skipped.items():
        print(f"  {key}: {why}")
    report = {"config": {"quick": args.quick, "repeats": repeats, "threads": args.threads,
                         "dtype": args.dtype, "seed": args.seed, "model": args.model,
                         "sizes": asdict(sizes)},
              "ceilings": ceilings, "summary": summary, "rows": [asdict(r) for r in rows],
              "runs": runs, "elapsed_s": time.monotonic() - started}
    (out / "bench.json").write_text(json.dumps(report, indent=1))
    (out / "table.txt").write_text(header + "\n" + table + "\n")
    plots = write_plots(out, runs, summary)
    log.info("wrote %s, %s%s in %.0f s", out / "bench.json", out / "table.txt",
             "".join(f", {p.name}" for p in plots), time.monotonic() - started)
    return 0


def _brief(result: dict) -> str:
    if "error" in result:
        return f"ERROR {result['error']}"
    if "skipped" in result:
        return f"skipped: {result['skipped']}"
    return (f"wall {result['wall_s']:.1f} s, out {result['output_tok_s']:.1f} tok/s, "
            f"total {result['total_tok_s']:.1f} tok/s, process {result.get('spawn_s', 0):.1f} s")


if __name__ == "__main__":
    sys.exit(main())
