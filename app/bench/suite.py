"""`kvscope bench` / `python -m app.bench`: KVScope's engine against transformers (and llama.cpp),
and its HTTP front-end against its ZeroMQ protocol.

    python -m app.bench --quick              # a few minutes: every workload, one repeat
    python -m app.bench --repeats 3 --out bench_out
    python -m app.bench --workloads streaming --repeats 2   # HTTP vs ZeroMQ, 32 streams
    python -m app.bench --workloads streams    # decode tok/s at 1, 4, 16, 64 concurrent streams
    python -m app.bench --workloads tiered,restart,kv-int8 --repeats 1   # KV tiers, int8 KV
    python -m app.bench --workloads tiered,restart --long    # the 2,000-token tier workloads
    python -m app.bench --workloads spec-ngram --repeats 1   # n-gram speculation vs none, 1 and 16
    python -m app.bench --workloads spec-draft --draft-model draft.gguf   # draft-model speculation

spec-ngram-N (N = 1, 16): chat prompts whose answer repeats the input (quote a document, edit
code), greedy: kvscope without speculation, kvscope-spec (n-gram prompt lookup), llama.cpp and
llama.cpp-lookup (llama-cpp-python's LlamaPromptLookupDecoding, 1 stream only); decode tok/s,
ratios, acceptance and whether the speculating texts equal kvscope's (app/bench/spec_*.py).
spec-draft-N: the same with kvscope-spec on `--draft-model` (skipped without one).

Workloads are built from a seed (app/bench/workloads.py: token ids drawn from the model's
ordinary vocabulary, output lengths, arrival times) and written as JSON; each (system, workload,
repeat) then runs in a fresh process, systems in turn (A B, then B A, ...) so machine drift hits all
of them alike: `python -m engine_proc.bench.worker` for the in-process engine, transformers and
llama.cpp; `python -m app.bench.clients` for the engine process behind its ZeroMQ and HTTP
front-ends (kvscope-zmq, kvscope-http). This module never imports torch, transformers or
engine_proc: everything it knows about the model comes from the `ceilings` worker.

Outputs: a table on stdout (ratios against the baseline measured in the same run, targets with
PASS/MISS; app/bench/table.py), `bench.json` and, when matplotlib is installed (the `bench`
extra), PNG plots, all in --out. Runs from any directory: every path argument is made absolute
before a worker sees it, and workers run in the caller's directory. Exit status 1 when every
system that ran failed (skipped ones, such as llama.cpp when it is not installed, do not count).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from app.bench.clients import CLIENT_SYSTEMS
from app.bench.disagg_table import DISAGG_SYSTEMS, DISAGG_WORKLOADS, disagg_rows, disagg_summary
from app.bench.kv_table import build_kv_rows
from app.bench.plots import NO_PLOTS, write_plots
from app.bench.spec_stats import exactness
from app.bench.spec_table import build_spec_rows, format_spec_table, spec_header
from app.bench.spec_workloads import NEEDS_DRAFT, spec_level
from app.bench.stats import summarize_workload
from app.bench.table import (
    build_rows,
    build_streams_rows,
    format_streams_table,
    format_table,
    streams_header,
)
from app.bench.workloads import (
    FULL,
    LONG,
    QUICK,
    WORKLOAD_SYSTEMS,
    WORKLOADS,
    Sizes,
    Vocab,
    default_workloads,
    expand_workloads,
    make_workload,
)
from app.supervisor import APP_DECODE_ACTIVATIONS, DECODE_ACTIVATIONS, DTYPES

log = logging.getLogger(__name__)

# Where the `app` and `engine_proc` packages live: a source checkout, or site-packages. Workers
# get it on PYTHONPATH so an uninstalled (or editable) checkout runs from any directory.
PACKAGE_ROOT = Path(__file__).resolve().parents[2]


def absolute(path: str | os.PathLike[str] | None) -> str | None:
    """A path argument as the caller meant it (relative to the caller's directory, ~ expanded),
    absolute, so a worker reads the same file wherever it runs."""
    return None if path is None else str(Path(path).expanduser().resolve())


# --------------------------------------------------------------------------------------------
# Running workers


def worker_command(system: str, workload_path: Path | None, args: argparse.Namespace,
                   timeout: float) -> list[str]:
    """The worker process of one run: app.bench.clients for the engine behind its front-ends
    (it spawns the engine itself), engine_proc.bench.worker for everything else."""
    common = ["--system", system, "--dtype", args.dtype, "--threads", str(args.threads)]
    if workload_path is not None:
        common += ["--workload", absolute(workload_path)]
    if args.model:
        common += ["--model", absolute(args.model)]
    if system in DISAGG_SYSTEMS or system in CLIENT_SYSTEMS:
        spawned = ["--timeout", str(max(1.0, timeout - 30.0)),
                   "--decode-weights", args.engine_decode_weights]
    if system in DISAGG_SYSTEMS:  # spawns its engines (one, or a prefill and a decode one)
        return [sys.executable, "-m", "app.bench.disagg", *common, *spawned]
    if system in CLIENT_SYSTEMS:
        # Engine start-up (the model load) is outside the measurement but inside `timeout`.
        return [sys.executable, "-m", "app.bench.clients", *common, *spawned]
    cmd = [sys.executable, "-m", "engine_proc.bench.worker", *common,
           "--hf-batch", str(args.hf_batch)]
    if args.quick:
        cmd.append("--quick")
    if args.cache_dir:
        cmd += ["--cache-dir", absolute(args.cache_dir)]
    return cmd


def run_worker(system: str, workload_path: Path | None, args: argparse.Namespace,
               timeout: float) -> dict:
    cmd = worker_command(system, workload_path, args, timeout)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE_ROOT), env.get("PYTHONPATH")]))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    start = time.monotonic()
    try:  # in the caller's directory, like any command it runs
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"system": system, "error": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    said = json.loads(lines[-1]) if lines else {}
    if proc.returncode != 0 and "error" in said:  # the worker's own reason (a ValueError)
        return {"system": system, "error": said["error"]}
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or "").strip().splitlines()[-5:]
        return {"system": system, "error": f"exit {proc.returncode}: " + " | ".join(tail)}
    result = said
    result["spawn_s"] = time.monotonic() - start
    return result


def llamacpp_installed() -> bool:
    """llama-cpp-python is an optional peer: without it the llamacpp system is skipped."""
    return importlib.util.find_spec("llama_cpp") is not None


def resolve_threads(requested: int | None) -> int:
    """All cores on an idle machine, one on a busy one: with two OpenMP threads on a loaded
    2-core box every parallel region waits for a descheduled thread (steps 100x slower)."""
    if requested:
        return requested
    cores = os.cpu_count() or 1
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return cores if load < 0.5 * cores else 1


# --------------------------------------------------------------------------------------------
# CLI


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvscope bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="small counts and lengths, one repeat (a few minutes on 2 cores)")
    ap.add_argument("--long", action="store_true",
                    help="the long versions of the KV-tier workloads (16 system prompts of 2,000 "
                    "tokens; about 30 minutes on 2 cores instead of a few)")
    ap.add_argument("--repeats", type=int, default=None, help="default 3, --quick 1")
    ap.add_argument("--workloads", default=None, nargs="+",
                    help=f"comma- or space-separated subset of {','.join(WORKLOADS)}; "
                    "`streams` = the streams-N workloads (N = 1,4,16,64; --quick 1,4,16), "
                    "`kv-int8` = kv-capacity,kv-decode-4k (default: all)")
    ap.add_argument("--systems", default="kvscope,hf,llamacpp",
                    help="which of kvscope,hf,llamacpp to run (the kvscope variants, "
                    "kvscope-zmq, kvscope-http and kvscope-spec included, follow kvscope; "
                    "llamacpp-lookup follows llamacpp)")
    ap.add_argument("--disaggregation", action="store_true",
                    help="also run interference and mixed on one colocated engine vs a prefill "
                    "and a decode engine (the cores split between them), same client")
    ap.add_argument("--engine-decode-weights", default="dense", choices=("dense", "int4", "auto"),
                    help="decode weights of the engine processes the kvscope-zmq/-http and "
                    "disaggregation runs spawn (auto: the app's CPU default, 4-bit weights and "
                    "the fused decode step)")
    ap.add_argument("--engine-decode-activations", default=APP_DECODE_ACTIVATIONS,
                    choices=DECODE_ACTIVATIONS,
                    help="the fused decode step's arithmetic in every KVScope engine of the run "
                    "(auto, the app's: int8 where our 4-bit kernels run; kvscope-exact runs "
                    "exact beside kvscope in the streams workloads anyway)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="GGUF file or HF directory (default SmolLM2)")
    ap.add_argument("--draft-model", default=None,
                    help="draft model of the spec-draft workloads (kvscope-spec's "
                    "speculative_config model); without it they are skipped")
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
    s = Sizes(**asdict(QUICK if args.quick else LONG if args.long else FULL))
    if args.hf_batch:
        s.hf_batch = args.hf_batch
    if args.rate:
        s.poisson_rate = args.rate
    if args.interference_chunk:
        s.interf_chunk = args.interference_chunk
    return s


def _plan(workloads: list[str], systems: list[str],
          disaggregation: bool = False) -> list[tuple[str, str]]:
    plan = []
    for w in workloads:
        for system in WORKLOAD_SYSTEMS[w]:
            family = system.split("-")[0]
            if family in systems:
                plan.append((w, system))
        if disaggregation and w in DISAGG_WORKLOADS:
            plan += [(w, system) for system in DISAGG_SYSTEMS]
    return plan


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.quick and args.long:
        print("error: --quick and --long exclude each other", file=sys.stderr)
        return 2
    sizes = _sizes(args)
    try:
        workloads = (default_workloads(sizes) if args.workloads is None else expand_workloads(
            [w.strip() for arg in args.workloads for w in arg.split(",") if w.strip()], sizes))
    except ValueError as exc:
        print(f"error: --workloads: {exc}", file=sys.stderr)
        return 2
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if any(s not in ("kvscope", "hf", "llamacpp") for s in systems):
        print("error: --systems must be a subset of kvscope,hf,llamacpp", file=sys.stderr)
        return 2
    args.hf_batch = sizes.hf_batch
    # Paths as the caller meant them, whatever directory a worker runs in.
    args.model, args.cache_dir = absolute(args.model), absolute(args.cache_dir)
    args.draft_model = absolute(args.draft_model)
    repeats = args.repeats or (1 if args.quick else 3)
    args.threads = resolve_threads(args.threads)
    timeout = args.timeout or (600.0 if args.quick else 7200.0)
    out = Path(absolute(args.out))
    (out / "workloads").mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    size = "quick" if args.quick else "long" if args.long else "full"
    log.info("bench: %s, %d repeat(s), %d thread(s), dtype %s, out %s", size, repeats,
             args.threads, args.dtype, out)

    log.info("[ceilings] machine ceilings and model facts (first run also caches the weights)")
    ceilings = run_worker("ceilings", None, args, timeout)
    if "error" in ceilings:
        print(f"error: the ceilings worker failed: {ceilings['error']}", file=sys.stderr)
        return 1
    model = ceilings["model"]
    log.info("[ceilings] read %.1f GB/s, fp32 %.1f GFLOP/s, bf16 %.1f GFLOP/s; %s, %.1fM params",
             ceilings["read_bw_gbs"], ceilings["fp32_matmul_gflops"],
             ceilings["bf16_matmul_gflops"], model["name"], model["num_params"] / 1e6)
    vocab = Vocab(model["vocab_size"], model["special_ids"], model.get("chat_prompts"))
    wl_defs, wl_paths = {}, {}
    for w in workloads:
        wl_defs[w] = make_workload(w, sizes, args.seed, vocab, args.draft_model)
        # every KVScope engine of the run (kvscope-exact and kvscope-int8 override it)
        wl_defs[w].setdefault("engine", {})["decode_activations"] = args.engine_decode_activations
        wl_paths[w] = out / "workloads" / f"{w}.json"
        wl_paths[w].write_text(json.dumps(wl_defs[w]))

    plan = _plan(workloads, systems, args.disaggregation)
    runs: dict[str, dict[str, list[dict]]] = {w: {} for w in workloads}
    total = len(plan) * repeats
    done = 0
    for rep in range(repeats):
        for w in workloads:  # per workload: A B, then B A, ... so drift hits both alike
            order = [system for ww, system in plan if ww == w]
            for system in order if rep % 2 == 0 else order[::-1]:
                done += 1
                log.info("[%d/%d] %s: %s (repeat %d/%d) ...", done, total, w, system,
                         rep + 1, repeats)
                if system.startswith("llamacpp") and not llamacpp_installed():
                    # What the worker would say, without paying for a process start.
                    result = {"system": system, "skipped": "llama-cpp-python is not installed "
                              "(pip install llama-cpp-python)"}
                elif w.startswith("spec-draft") and not args.draft_model:
                    result = {"system": system, "skipped": NEEDS_DRAFT}
                else:
                    result = run_worker(system, wl_paths[w], args, timeout)
                runs[w].setdefault(system, []).append(result)
                log.info("[%d/%d] %s: %s -> %s", done, total, w, system, _brief(result))
    summary = {w: {s: summarize_workload(w, rs, wl_defs[w]) for s, rs in by.items()}
               for w, by in runs.items()}
    for w, by in runs.items():
        for system in DISAGG_SYSTEMS:
            if system in by and "error" not in summary[w][system]:
                summary[w][system].update(disagg_summary(by[system]))
    rows = build_rows(summary, ceilings) + build_kv_rows(summary) + disagg_rows(summary)
    streams_rows = build_streams_rows(summary)
    spec_exact = {w: exactness(by) for w, by in runs.items() if spec_level(w)}
    spec_rows = build_spec_rows(summary, spec_exact)
    header = (f"KVScope bench ({size}, {repeats} repeat(s), "
              f"{args.threads} thread(s), {args.dtype}, {model['name']}, hf static batch "
              f"{sizes.hf_batch}, interference chunk {sizes.interf_chunk}); ratio = kvscope "
              f"over baseline (for latencies: baseline over kvscope; streaming: kvscope-http "
              f"over kvscope-zmq; KV tiers: the tier system against recomputing; int8 KV: "
              f"kvscope-kvint8 over the model-dtype KV), medians over repeats")
    if args.engine_decode_activations != APP_DECODE_ACTIVATIONS:  # every KVScope engine
        header += (f"; every KVScope engine with --decode-activations "
                   f"{args.engine_decode_activations}, kvscope's columns included")
    text = [header]
    if rows:
        text.append(format_table(rows))
    if streams_rows:
        text += ["", streams_header(summary, sizes), format_streams_table(streams_rows)]
    if spec_rows:
        text += ["", spec_header(sizes.spec_new), format_spec_table(spec_rows)]
    print("\n".join(text))
    skipped = {f"{w}/{s}": r[0].get("skipped") or r[0].get("error")
               for w, by in runs.items() for s, r in by.items()
               if r and ("skipped" in r[0] or "error" in r[0])}
    for key, why in skipped.items():
        if not str(why).startswith("n/a:"):  # by design, and the table's notes say why
            print(f"  {key}: {why}")
    report = {"config": {"quick": args.quick, "long": args.long, "repeats": repeats,
                         "threads": args.threads,
                         "dtype": args.dtype, "seed": args.seed, "model": args.model,
                         "draft_model": args.draft_model,
                         "workloads": workloads, "sizes": asdict(sizes)},
              "ceilings": ceilings, "summary": summary, "rows": [asdict(r) for r in rows],
              "streams_rows": [asdict(r) for r in streams_rows],
              "spec_rows": [asdict(r) for r in spec_rows], "spec_exact": spec_exact,
              "runs": runs, "elapsed_s": time.monotonic() - started}
    (out / "bench.json").write_text(json.dumps(report, indent=1))
    (out / "table.txt").write_text("\n".join(text) + "\n")
    plots = write_plots(out, runs, summary)
    if plots is None:
        print(NO_PLOTS)
    elif plots:
        print("plots: " + ", ".join(str(p) for p in plots))
    log.info("wrote %s, %s in %.0f s", out / "bench.json", out / "table.txt",
             time.monotonic() - started)
    failed = all_failed(runs)
    if failed:
        print(f"error: every system that ran failed ({failed} run(s)); see the reasons above "
              f"and {out / 'bench.json'}", file=sys.stderr)
        return 1
    return 0


def all_failed(runs: dict[str, dict[str, list[dict]]]) -> int:
    """The number of failed runs when every run that was not skipped failed, else 0."""
    ran = [r for by in runs.values() for rs in by.values() for r in rs if "skipped" not in r]
    return len(ran) if ran and all("error" in r for r in ran) else 0


def _brief(result: dict) -> str:
    if "error" in result:
        return f"ERROR {result['error']}"
    if "skipped" in result:
        return f"skipped: {result['skipped']}"
    return (f"wall {result['wall_s']:.1f} s, out {result['output_tok_s']:.1f} tok/s, "
            f"total {result['total_tok_s']:.1f} tok/s, process {result.get('spawn_s', 0):.1f} s")


if __name__ == "__main__":
    sys.exit(main())
