"""One benchmark run: ONE system on ONE workload, in a fresh process, one JSON line on stdout.

    python -m engine_proc.bench_worker --system kvscope --workload wl.json [--dtype float32]
    python -m engine_proc.bench_worker --system ceilings [--quick]

`app.bench` writes the workload (token ids, output lengths, arrivals) and spawns this module once
per (system, workload, repeat), so every system gets byte-identical inputs and none inherits
another's warm state or memory. Systems:

- kvscope, kvscope-int4 (4-bit decode weights), kvscope-nocache (prefix caching off),
  kvscope-nochunk (long_prefill_chunk 0 and a token budget that holds the longest prompt): the
  in-process LLMEngine.
- hf: transformers `generate()` with static batching (left padding, batches of up to
  `hf_batch` requests in arrival order, a batch runs until its longest request is done).
- llamacpp: llama-cpp-python when importable, else a `skipped` result with the reason.
- ceilings: memory read bandwidth and fp32/bf16 matmul FLOP/s of this machine, plus the model's
  parameter count and vocabulary (what app.bench needs to build workloads).

Workload JSON: {"name", "requests": [{"id", "prompt": [ids], "max_tokens",
"arrival_s" | "after": {"request": id, "tokens": n (-1 = finished)}}], "engine": {EngineConfig
overrides}, "hf_batch": N}. Times are `time.monotonic()` seconds, relative to the run start.

Loading the default GGUF takes ~10 s (engine) and ~60 s (transformers) of dequantization, so the
dequantized weights are cached under --cache-dir (keyed by file, size, mtime, dtype and loader
version); load time is reported but never part of a measurement.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import logging
import math
import os
import pickle
import resource
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
WARMUP_PROMPT = list(range(100, 132))  # 32 ordinary token ids of any Llama-family vocabulary
WARMUP_TOKENS = 4


# --------------------------------------------------------------------------------------------
# Workload and request bookkeeping (shared by every system)


@dataclass(slots=True)
class Req:
    id: str
    prompt: list[int]
    max_tokens: int
    arrival_s: float | None  # relative to the run start; None = event-triggered
    after: dict | None  # {"request": id, "tokens": n}, n = -1: when that request finished
    issued: float | None = None  # absolute monotonic time the request entered the system
    token_times: list[float] = field(default_factory=list)  # absolute
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
        out.append(Req(rid, prompt, max_tokens, arrival, after))
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


def request_results(reqs: list[Req], t0: float) -> list[dict]:
    rows = []
    for r in reqs:
        t = r.token_times
        ttft = t[0] - r.issued if t and r.issued is not None else None
        itl = [b - a for a, b in zip(t, t[1:], strict=False)]
        rows.append(
            {
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
        )
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
# Model loading with a dequantized-weights cache


def _cache_key(path: Path, dtype: str, tag: str) -> str:
    st = path.stat()
    import engine_proc.model_loader as ml

    loader = Path(ml.__file__).stat().st_mtime_ns
    raw = f"{tag}|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{dtype}|{loader}"
    return f"{tag}-{hashlib.sha256(raw.encode()).hexdigest()[:16]}"


def model_path(model: str | None) -> Path:
    from engine_proc.model_loader import default_model_path

    return default_model_path() if model is None else Path(model).expanduser().resolve()


def load_engine_checkpoint(model: str | None, dtype: str, cache_dir: Path | None) -> Any:
    """engine_proc.model_loader.load_checkpoint, cached for GGUF files."""
    import torch
    from safetensors.torch import load_file, save_file

    from engine_proc.model_loader import Checkpoint, load_checkpoint

    torch_dtype = getattr(torch, dtype)
    path = model_path(model)
    if cache_dir is None or not path.is_file():
        return load_checkpoint(model, torch_dtype)
    d = cache_dir / _cache_key(path, dtype, "kvscope")
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


def load_hf_model(model: str | None, dtype: str, cache_dir: Path | None) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype)
    path = model_path(model)
    if not path.is_file():
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype).eval()
    if cache_dir is None:
        return AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch_dtype
        ).eval()
    d = cache_dir / _cache_key(path, "float32", "hf")
    if not (d / "done").exists():
        logger.info("converting %s with transformers (first run only)", path.name)
        m = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
        _save_hf_plain(m, d)
        del m
    return AutoModelForCausalLM.from_pretrained(str(d), dtype=torch_dtype).eval()


def _save_hf_plain(model: Any, d: Path) -> None:
    """save_pretrained refuses GGUF-loaded models; the dequantized weights are plain tensors."""
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # the same storage as the embedding
    save_file(
        {k: v.contiguous() for k, v in state.items()},
        str(d / "model.safetensors"),
        metadata={"format": "pt"},
    )
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(str(d))
    (d / "done").touch()


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
            params = SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True)
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
# transformers, static batching


def run_hf(workload: dict, args: argparse.Namespace) -> dict:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    t_load = time.monotonic()
    model = load_hf_model(args.model, args.dtype, args.cache_dir)
    load_s = time.monotonic() - t_load
    if args.device not in ("auto", "cpu"):
        model = model.to(args.device)
    elif args.device == "auto" and torch.cuda.is_available():
        model = model.to("cuda")
    device = next(model.parameters()).device
    eos = model.config.eos_token_id
    pad_id = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
    batch_size = int(workload.get("hf_batch", args.hf_batch))
    clock = time.monotonic

    def generate(prompts: list[list[int]], max_new: int) -> list[float]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: every row ends at the same column
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        stamps: list[float] = []

        def stamp(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            stamps.append(clock())  # logits of this step exist; its token is picked next
            return scores

        with torch.inference_mode():
            out = model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=pad_id,
                logits_processor=[stamp],
            )
        assert out.shape[1] - width == max_new, (out.shape, width, max_new)
        return stamps

    generate([WARMUP_PROMPT], WARMUP_TOKENS)
    reqs = parse_workload(workload)
    t0 = clock()
    batches = 0
    for batch in arrived_batches(Issuer(reqs, t0), clock, batch_size):
        stamps = generate([r.prompt for r in batch], max(r.max_tokens for r in batch))
        for r in batch:
            # Generous to the baseline: a request counts as done at its own last token, not
            # when its batch ends.
            r.token_times = stamps[: r.max_tokens]
            r.num_out = len(r.token_times)
            r.finished = True
        batches += 1
    result = summarize(reqs, t0)
    result.update(
        {
            "load_s": load_s,
            "batches": batches,
            "hf_batch": batch_size,
            "prefix_hit_rate": None,
            "requests": request_results(reqs, t0),
        }
    )
    return result


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


# --------------------------------------------------------------------------------------------
# llama.cpp (optional)


def run_llamacpp(workload: dict, args: argparse.Namespace) -> dict:
    if importlib.util.find_spec("llama_cpp") is None:
        return {"skipped": "llama-cpp-python is not installed (pip install llama-cpp-python)"}
    path = model_path(args.model)
    if not path.is_file():
        return {"skipped": f"llama.cpp needs a .gguf file, got directory {path}"}
    from llama_cpp import Llama

    t_load = time.monotonic()
    llm = Llama(
        model_path=str(path),
        n_ctx=4096,
        n_batch=512,
        verbose=False,
        n_threads=args.threads or os.cpu_count(),
    )
    load_s = time.monotonic() - t_load
    clock = time.monotonic
    reqs = parse_workload(workload)
    t0 = clock()
    # llama-cpp-python serves one sequence at a time
    for (r,) in arrived_batches(Issuer(reqs, t0), clock, 1):
        llm.reset()
        for _ in llm.generate(r.prompt, temp=0.0, reset=True):
            r.token_times.append(clock())
            if len(r.token_times) >= r.max_tokens:
                break
        r.num_out, r.finished = len(r.token_times), True
    result = summarize(reqs, t0)
    result.update(
        {"load_s": load_s, "prefix_hit_rate": None, "requests": request_results(reqs, t0)}
    )
    return result


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
        return run_llamacpp(workload, args)
    if args.system == "hf":
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
