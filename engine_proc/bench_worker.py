"""One benchmark run: ONE system on ONE workload, in a fresh process, one JSON line on stdout.

    python -m engine_proc.bench_worker --system kvscope --workload wl.json [--dtype float32]
    python -m engine_proc.bench_worker --system ceilings [--quick]

`app.bench` writes the workload (token ids, output lengths, arrivals) and spawns this module once
per (system, workload, repeat), so every system gets byte-identical inputs and none inherits
another's warm state or memory. Systems:

- kvscope, kvscope-int4 (4-bit decode weights), kvscope-nocache (prefix caching off),
  kvscope-nochunk (long_prefill_chunk 0 and a token budget that holds the longest prompt): the
  in-process LLMEngine (this module).
- hf: transformers `generate()` with static batching (engine_proc/bench_hf.py).
- llamacpp: llama-cpp-python's batched C API when importable, else a `skipped` result with the
  reason (engine_proc/bench_llamacpp.py).
- ceilings: memory read bandwidth and fp32/bf16 matmul FLOP/s of this machine, plus the model's
  parameter count and vocabulary (what app.bench needs to build workloads).

Workload JSON: {"name", "requests": [{"id", "prompt": [ids], "max_tokens",
"arrival_s" | "after": {"request": id, "tokens": n (-1 = finished)}, optional "temperature",
"seed"}], "engine": {EngineConfig overrides}, "hf_batch": N}. Times are `time.monotonic()`
seconds, relative to the run start (engine_proc/bench_common.py: parsing, arrivals, results).

Loading the default GGUF takes ~10 s (engine) and ~60 s (transformers) of dequantization, so the
dequantized weights are cached under --cache-dir (keyed by file, size, mtime, dtype and loader
version); load time is reported but never part of a measurement.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import pickle
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine_proc.bench_common import (
    WARMUP_PROMPT,
    WARMUP_TOKENS,
    Issuer,
    Req,
    cache_key,
    model_path,
    parse_workload,
    peak_rss_mb,
    request_results,
    summarize,
)
from engine_proc.bench_llamacpp import FLASH_ATTN, KV_LAYOUTS
from engine_proc.config import SUPPORTED_DTYPES

logger = logging.getLogger(__name__)

SYSTEMS = (
    "kvscope",
    "kvscope-int4",
    "kvscope-nocache",
    "kvscope-nochunk",
    "hf",
    "llamacpp",
    "ceilings",
)
SNAPSHOT_EVERY = 4  # engine steps between KV occupancy samples


# --------------------------------------------------------------------------------------------
# Model loading with a dequantized-weights cache


def load_engine_checkpoint(model: str | None, dtype: str, cache_dir: Path | None) -> Any:
    """engine_proc.model_loader.load_checkpoint, cached for GGUF files."""
    import torch
    from safetensors.torch import load_file, save_file

    from engine_proc.model_loader import Checkpoint, load_checkpoint

    torch_dtype = getattr(torch, dtype)
    path = model_path(model)
    if cache_dir is None or not path.is_file():
        return load_checkpoint(model, torch_dtype)
    d = cache_dir / cache_key(path, dtype, "kvscope")
    if (d / "done").exists():
        with open(d / "meta.pkl", "rb") as f:
            meta = pickle.load(f)
        return Checkpoint(weights=load_file(str(d / "weights.safetensors")), **meta)
    ckpt = load_checkpoint(str(path), torch_dtype)
    d.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in ckpt.weights.items()}, str(d / "weights.safetensors"))
    meta = {
        "config": ckpt.config,
        "tokenizer": ckpt.tokenizer,
        "model_id": ckpt.model_id,
        "display_name": ckpt.display_name,
    }
    with open(d / "meta.pkl", "wb") as f:
        pickle.dump(meta, f)
    (d / "done").touch()
    logger.info("cached dequantized weights in %s", d)
    return ckpt


# --------------------------------------------------------------------------------------------
# kvscope


def engine_config_for(system: str, workload: dict, args: argparse.Namespace) -> Any:
    from engine_proc import EngineConfig

    reqs = workload["requests"]
    longest = max(len(r["prompt"]) for r in reqs)
    kw: dict[str, Any] = {
        "model": args.model,
        "dtype": args.dtype,
        "num_threads": args.threads,
        "device": args.device,
    }
    kw.update(workload.get("engine", {}))
    # The pool holds every request at full length at once: the benchmark measures scheduling
    # and compute, not preemption (which is still counted and reported).
    block = kw.get("block_size", 16)
    need = sum(-(-(len(r["prompt"]) + r["max_tokens"]) // block) for r in reqs)
    kw.setdefault("num_kv_blocks", args.kv_blocks or need + 64)
    if system == "kvscope-int4":
        kw["decode_weights"] = "int4"
    elif system == "kvscope-nocache":
        kw["enable_prefix_caching"] = False
    elif system == "kvscope-nochunk":
        kw["long_prefill_chunk"] = 0
        kw["max_num_batched_tokens"] = max(kw.get("max_num_batched_tokens", 2048), longest + 256)
    return EngineConfig(**kw)


def run_kvscope(system: str, workload: dict, args: argparse.Namespace) -> dict:
    from engine_proc import LLMEngine, SamplingParams

    t_load = time.monotonic()
    config = engine_config_for(system, workload, args)
    ckpt = load_engine_checkpoint(args.model, args.dtype, args.cache_dir)
    engine = LLMEngine(config, checkpoint=ckpt)
    del ckpt
    load_s = time.monotonic() - t_load
    clock = engine.clock
    engine.generate(
        [WARMUP_PROMPT], SamplingParams(max_tokens=WARMUP_TOKENS, temperature=0, ignore_eos=True)
    )
    engine.reset_prefix_cache()
    base = engine.snapshot().counters
    reqs = parse_workload(workload)
    by_id = {r.id: r for r in reqs}
    occ = {
        "filled_bytes": 0.0,
        "paged_bytes": 0.0,
        "contiguous_bytes": 0.0,
        "contiguous_need_bytes": 0.0,
        "samples": 0,
    }
    kv_bpt = engine.kv_bytes_per_token
    active: dict[str, Req] = {}
    num_steps = 0
    t0 = clock()
    issuer = Issuer(reqs, t0)
    while issuer.pending or active:
        for r in issuer.due(clock()):
            params = SamplingParams(max_tokens=r.max_tokens, temperature=r.temperature,
                                    seed=r.seed, ignore_eos=True)
            engine.add_request(r.id, r.prompt, params)
            active[r.id] = r
        if not active:
            issuer.wait_for_next(clock)
            continue
        for out in engine.step():
            r = by_id[out.request_id]
            r.num_out = len(out.token_ids)
            r.num_cached = out.num_cached_tokens
            if out.finished:
                assert out.metrics is not None
                r.token_times = list(out.metrics.token_times)
                r.token_ids = list(out.token_ids)
                r.finished = True
                del active[r.id]
        num_steps += 1
        if num_steps % SNAPSHOT_EVERY == 0:
            _sample_occupancy(engine, active, occ, kv_bpt)
    counters = engine.snapshot().counters
    result = summarize(reqs, t0)
    queries = counters["prefix_cache_queries"] - base["prefix_cache_queries"]
    hits = counters["prefix_cache_hits"] - base["prefix_cache_hits"]
    result.update(
        {
            "load_s": load_s,
            "steps": num_steps,
            "prefix_cache_queries": queries,
            "prefix_cache_hits": hits,
            "prefix_hit_rate": hits / queries if queries else None,
            "num_preemptions": counters["num_preemptions"] - base["num_preemptions"],
            "kv": _occupancy_result(occ),
            "engine_config": engine.live_config()
            | {"num_kv_blocks": engine.num_blocks, "block_size": engine.block_size},
            "model_info": engine.model_info(),
            "requests": request_results(reqs, t0),
        }
    )
    return result


def _sample_occupancy(engine: Any, active: dict[str, Req], occ: dict, kv_bpt: int) -> None:
    c = engine.snapshot().counters
    in_use = c["kv_bytes_in_use"]
    if not in_use:
        return
    occ["samples"] += 1
    occ["filled_bytes"] += c["kv_token_occupancy"] * in_use
    occ["paged_bytes"] += in_use
    # vLLM paper's baseline reserves max_model_len per request; a kinder contiguous allocator
    # reserves each request's own prompt + max_tokens. Both are reported.
    occ["contiguous_bytes"] += c["contiguous_kv_bytes"]
    occ["contiguous_need_bytes"] += kv_bpt * sum(
        len(r.prompt) + r.max_tokens for r in active.values()
    )


def _occupancy_result(occ: dict) -> dict:
    filled = occ["filled_bytes"]

    def ratio(total: float) -> float | None:
        return filled / total if total else None

    n = occ["samples"]
    return {
        "samples": n,
        "paged_token_occupancy": ratio(occ["paged_bytes"]),
        "contiguous_max_len_occupancy": ratio(occ["contiguous_bytes"]),
        "contiguous_per_request_occupancy": ratio(occ["contiguous_need_bytes"]),
        "mean_paged_bytes": occ["paged_bytes"] / n if n else 0.0,
        "mean_contiguous_bytes": occ["contiguous_bytes"] / n if n else 0.0,
    }


# --------------------------------------------------------------------------------------------
# Machine ceilings


def _best_time(fn: Callable[[], Any], reps: int) -> float:
    fn()
    best = math.inf
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _bandwidth_times(n_bytes: int, reps: int) -> tuple[float, float]:
    import torch

    x = torch.ones(n_bytes // 4, dtype=torch.float32)
    y = torch.empty_like(x)
    return _best_time(x.sum, reps), _best_time(lambda: y.copy_(x), reps)


def run_ceilings(args: argparse.Namespace) -> dict:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    reps = 3 if args.quick else 7
    n_bytes = (256 if args.quick else 512) * 2**20
    t_sum, t_copy = _bandwidth_times(n_bytes, reps)
    result: dict[str, Any] = {
        "threads": torch.get_num_threads(),
        "read_bw_gbs": n_bytes / t_sum / 1e9,
        "copy_bw_gbs": 2 * n_bytes / t_copy / 1e9,  # read + write
    }
    n = 512 if args.quick else 1024
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a = torch.randn(n, n).to(dt)
        b = torch.randn(n, n).to(dt)
        t = _best_time(lambda a=a, b=b: a @ b, reps)
        result[f"{name}_matmul_gflops"] = 2 * n**3 / t / 1e9
    result["matmul_n"] = n
    result["model"] = model_facts(args)
    return result


def model_facts(args: argparse.Namespace) -> dict:
    """Parameter count, weight bytes per decoded token and the vocabulary app.bench samples."""
    ckpt = load_engine_checkpoint(args.model, args.dtype, args.cache_dir)
    seen: set[int] = set()
    params = 0
    for w in ckpt.weights.values():  # tied embeddings are one tensor, read once per step
        if w.data_ptr() not in seen:
            seen.add(w.data_ptr())
            params += w.numel()
    itemsize = next(iter(ckpt.weights.values())).element_size()
    tok = ckpt.tokenizer
    special = sorted(set(tok.all_special_ids) | set(getattr(tok, "added_tokens_decoder", {})))
    return {
        "name": ckpt.display_name,
        "num_params": params,
        "weight_bytes": params * itemsize,
        "dtype": args.dtype,
        "vocab_size": ckpt.config.vocab_size,
        "special_ids": special,
        "eos_token_ids": list(ckpt.config.eos_token_ids),
    }


# --------------------------------------------------------------------------------------------
# CLI


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m engine_proc.bench_worker",
        description="Run one system on one workload; print one JSON line.",
    )
    ap.add_argument("--system", required=True, choices=SYSTEMS)
    ap.add_argument(
        "--workload",
        default=None,
        help="workload JSON file, or - for stdin (not needed for ceilings)",
    )
    ap.add_argument("--quick", action="store_true", help="smaller ceiling measurements")
    ap.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2)")
    ap.add_argument("--dtype", default="float32", choices=SUPPORTED_DTYPES)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--hf-batch", type=int, default=8, help="static batch size of the hf system")
    ap.add_argument(
        "--kv-blocks",
        type=int,
        default=None,
        help="KV pool size (default: fits every request of the workload at full length)",
    )
    ap.add_argument(
        "--cache-dir",
        default=str(Path.home() / ".cache" / "kvscope" / "bench"),
        help="dequantized-weights cache",
    )
    ap.add_argument("--no-cache", action="store_true", help="load the model from scratch")
    ap.add_argument("--llamacpp-kv", default="split", choices=KV_LAYOUTS,
                    help="llama.cpp KV layout: one stream per sequence (llama.cpp's default for "
                    "several sequences) or one shared buffer (llama-server -kvu)")
    ap.add_argument("--llamacpp-flash-attn", default="auto", choices=FLASH_ATTN,
                    help="llama.cpp flash attention (default: llama.cpp's own choice)")
    ap.add_argument("--log-level", default="WARNING")
    return ap


def run(args: argparse.Namespace) -> dict:
    args.cache_dir = None if args.no_cache else Path(args.cache_dir)
    if args.system == "ceilings":
        return run_ceilings(args)
    if args.workload is None:
        raise ValueError(f"--workload is required for system {args.system!r}")
    if args.workload == "-":
        workload = json.load(sys.stdin)
    else:
        with open(args.workload) as f:
            workload = json.load(f)
    if args.system == "llamacpp":
        from engine_proc.bench_llamacpp import run_llamacpp

        return run_llamacpp(workload, args)
    if args.system == "hf":
        from engine_proc.bench_hf import run_hf

        return run_hf(workload, args)
    return run_kvscope(args.system, workload, args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    start = time.monotonic()
    header = {"system": args.system, "dtype": args.dtype, "pid": os.getpid()}
    try:
        result = run(args)
    except ValueError as exc:
        print(json.dumps(header | {"error": str(exc)}))
        return 2
    header["workload"] = None
    if args.workload not in (None, "-"):
        header["workload"] = Path(args.workload).stem
    result = header | result | {"peak_rss_mb": peak_rss_mb(), "process_s": time.monotonic() - start}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
