"""One benchmark run: ONE system on ONE workload, in a fresh process, one JSON line on stdout.

    python -m engine_proc.bench.worker --system kvscope --workload wl.json [--dtype float32]
    python -m engine_proc.bench.worker --system ceilings [--quick]

`app.bench` writes the workload (token ids, output lengths, arrivals) and spawns this module once
per (system, workload, repeat), so every system gets byte-identical inputs and none inherits
another's warm state or memory. Systems:

- kvscope and its variants (kvscope-int4: 4-bit decode weights, kvscope-nocache,
  kvscope-nochunk, and the KV-memory configurations kvscope-recompute, kvscope-host,
  kvscope-disk, kvscope-kvint8): the in-process LLMEngine (engine_proc/bench/kvscope.py; the
  serving loop: engine_proc/bench/serve.py).
- hf: transformers `generate()` with static batching (engine_proc/bench/hf.py).
- llamacpp: llama-cpp-python's batched C API when importable, else a `skipped` result with the
  reason (engine_proc/bench/llamacpp.py); llamacpp-lookup: its high-level Llama with prompt-lookup
  decoding, one sequence at a time (engine_proc/bench/llamacpp_lookup.py).
- ceilings: memory read bandwidth and fp32/bf16 matmul FLOP/s of this machine, plus the model's
  parameter count, vocabulary and the spec workloads' chat prompts as token ids (what app.bench
  needs to build workloads).

Workload JSON: {"name", "requests": [{"id", "prompt": [ids], "max_tokens",
"arrival_s" | "after": {"request": id, "tokens": n (-1 = finished)}, optional "temperature",
"seed"}], "engine": {EngineConfig overrides}, "hf_batch": N, "meta": {...}}. Times are
`time.monotonic()` seconds, relative to the run start (engine_proc/bench/common.py: parsing,
arrivals, results).

Loading the default GGUF takes seconds (engine) and ~60 s (transformers) of dequantization, so
the dequantized weights are cached under --cache-dir (keyed by file, size, mtime, dtype and
loader version); load time is reported but never part of a measurement.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine_proc.bench.common import peak_rss_mb
from engine_proc.bench.kvscope import SYSTEMS as KVSCOPE_SYSTEMS
from engine_proc.bench.kvscope import load_engine_checkpoint, run_kvscope
from engine_proc.bench.llamacpp import FLASH_ATTN, KV_LAYOUTS
from engine_proc.bench.spec_prompts import chat_prompt_ids
from engine_proc.config import SUPPORTED_DTYPES

logger = logging.getLogger(__name__)

SYSTEMS = (*KVSCOPE_SYSTEMS, "hf", "llamacpp", "llamacpp-lookup", "ceilings")


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
        # The spec workloads' real prompts under this model's chat template: app.bench cannot
        # tokenize (it imports no transformers), and every system must get the same ids.
        "chat_prompts": chat_prompt_ids(tok),
    }


# --------------------------------------------------------------------------------------------
# CLI


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m engine_proc.bench.worker",
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
        from engine_proc.bench.llamacpp import run_llamacpp

        return run_llamacpp(workload, args)
    if args.system == "llamacpp-lookup":
        from engine_proc.bench.llamacpp_lookup import run_llamacpp_lookup

        return run_llamacpp_lookup(workload, args)
    if args.system == "hf":
        from engine_proc.bench.hf import run_hf

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
