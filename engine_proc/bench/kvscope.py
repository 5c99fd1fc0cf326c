"""The benchmark's kvscope systems: the in-process LLMEngine serving one workload.

Systems (each a KVScope configuration):
- kvscope: the engine as configured by the workload; kvscope-int4: 4-bit decode weights;
  kvscope-int8 / kvscope-exact: the workload's engine with decode_activations "int8" / "exact";
  kvscope-nocache: prefix caching off; kvscope-nochunk: long_prefill_chunk 0 and a token budget
  that holds the longest prompt.
- kvscope-recompute: no lower KV tiers (what an evicted prefix costs without them);
  kvscope-host / kvscope-disk: a host-memory / disk KV tier holding the workload's
  `meta.tier_blocks` blocks (the disk tier in a temporary directory, removed afterwards; its
  files are dropped from the OS page cache whenever no request runs, so every disk hit is a
  device read); kvscope-kvint8: int8 KV cache.
- kvscope-spec: speculative decoding with the workload's `meta.speculative_config` (the spec
  workloads: n-gram prompt lookup, or a draft model); the run reports the engine's spec_decode
  counters (drafted and accepted tokens) of the measured requests.

A workload with `meta.prime` (restart) first serves those requests, shuts the engine down
(flushing its cached blocks into the tiers), starts a fresh engine on the same disk directory and
serves the rest there: the measured requests are the restarted engine's.

Dequantizing the default GGUF takes seconds; load_engine_checkpoint caches the result under
--cache-dir (keyed by file, size, mtime, dtype and loader version).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import pickle
import shutil
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from engine_proc.bench.common import (
    WARMUP_PROMPT,
    WARMUP_TOKENS,
    cache_key,
    model_path,
    parse_workload,
    request_results,
    summarize,
)
from engine_proc.bench.serve import Occupancy, drop_page_cache, serve

logger = logging.getLogger(__name__)

SYSTEMS = ("kvscope", "kvscope-int4", "kvscope-int8", "kvscope-exact", "kvscope-nocache",
           "kvscope-nochunk",
           "kvscope-recompute", "kvscope-host", "kvscope-disk", "kvscope-kvint8", "kvscope-spec")
TIER_SYSTEMS = ("kvscope-host", "kvscope-disk")
# Room per block beyond its K/V bytes in a tier (a disk entry's header, an entry's scales).
TIER_ENTRY_OVERHEAD = 4096
# The tier workloads' warm-up: shorter than one KV block even with its output, so it leaves
# nothing cached and needs no prefix-cache reset (which would also empty the lower tiers).
SHORT_WARMUP = WARMUP_PROMPT[:8]
TIER_COUNTER_PREFIXES = ("kv_host_", "kv_disk_", "external_prefix_cache_")


def load_engine_checkpoint(model: str | None, dtype: str, cache_dir: Path | None) -> Any:
    """engine_proc.loading.loader.load_checkpoint, cached for GGUF files."""
    import torch
    from safetensors.torch import load_file, save_file

    from engine_proc.loading.loader import Checkpoint, load_checkpoint

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


def tier_options(system: str, workload: dict, block_bytes: int, disk_dir: str | None) -> dict:
    """EngineConfig keywords of a tier system: a tier that holds the workload's tier_blocks."""
    if system not in TIER_SYSTEMS:
        return {}
    blocks = workload.get("meta", {}).get("tier_blocks")
    if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1:
        raise ValueError(f"system {system!r} needs workload.meta.tier_blocks, an integer >= 1 "
                         f"(the blocks its KV tier must hold), got {blocks!r}")
    size = blocks * (block_bytes + TIER_ENTRY_OVERHEAD)
    if system == "kvscope-host":
        return {"kv_host_memory": size}
    assert disk_dir is not None
    return {"kv_disk_dir": disk_dir, "kv_disk_bytes": size}


def engine_config_for(system: str, workload: dict, args: argparse.Namespace,
                      kv_bytes_per_token: int = 0, disk_dir: str | None = None) -> Any:
    """The EngineConfig of `system` on `workload`; kv_bytes_per_token (of the model-dtype KV)
    sizes the tier systems' tiers."""
    from engine_proc import EngineConfig

    if system not in SYSTEMS:
        raise ValueError(f"kvscope system must be one of {SYSTEMS}, got {system!r}")
    reqs = workload["requests"]
    longest = max(len(r["prompt"]) for r in reqs)
    kw: dict[str, Any] = {
        "model": args.model,
        "dtype": args.dtype,
        "num_threads": args.threads,
        "device": args.device,
    }
    kw.update(workload.get("engine", {}))
    if "num_kv_blocks" not in kw and "kv_cache_memory" not in kw:  # the workload's pool wins
        # The pool holds every request at full length at once: the benchmark measures
        # scheduling and compute, not preemption (which is still counted and reported).
        block = kw.get("block_size", 16)
        need = sum(-(-(len(r["prompt"]) + r["max_tokens"]) // block) for r in reqs)
        kw["num_kv_blocks"] = args.kv_blocks or need + 64
    if system == "kvscope-int4":
        kw["decode_weights"] = "int4"
    elif system == "kvscope-int8":  # the fused step on 8-bit activations, llama.cpp's arithmetic
        kw["decode_activations"] = "int8"
    elif system == "kvscope-exact":  # the fused step on float32 activations (the engine's default)
        kw["decode_activations"] = "exact"
    elif system == "kvscope-nocache":
        kw["enable_prefix_caching"] = False
    elif system == "kvscope-nochunk":
        kw["long_prefill_chunk"] = 0
        kw["max_num_batched_tokens"] = max(kw.get("max_num_batched_tokens", 2048), longest + 256)
    elif system == "kvscope-kvint8":
        kw["kv_cache_dtype"] = "int8"
    elif system == "kvscope-spec":
        spec = workload.get("meta", {}).get("speculative_config")
        if not spec:
            raise ValueError("system 'kvscope-spec' needs workload.meta.speculative_config (the "
                             "spec-ngram / spec-draft workloads)")
        kw["speculative_config"] = spec
    block_bytes = kv_bytes_per_token * kw.get("block_size", 16)
    kw.update(tier_options(system, workload, block_bytes, disk_dir))
    return EngineConfig(**kw)


def _build(config: Any, args: argparse.Namespace, ckpt: Any = None) -> Any:
    from engine_proc import LLMEngine
    from engine_proc.config import largest_chunk

    if ckpt is None:
        ckpt = load_engine_checkpoint(args.model, args.dtype, args.cache_dir)
    engine = LLMEngine(config, checkpoint=ckpt)
    groups = engine.kv_layout.num_groups
    if groups > 1 and args.kv_blocks is None and config.num_kv_blocks is not None:
        # A hybrid KV cache (sliding-window layers) keeps one table per group of layers: the
        # pool sized for one table holds a request in each, plus each sliding group's reserve.
        chunk = largest_chunk(config.long_prefill_chunk, config.max_num_batched_tokens)
        reserve = sum(-(-(window + chunk) // engine.block_size) + 1
                      for window in engine.kv_layout.windows[1:])  # as max_total_tokens counts
        config = dataclasses.replace(config,
                                     num_kv_blocks=config.num_kv_blocks * groups + reserve)
        engine = LLMEngine(config, checkpoint=ckpt)
    return engine


def _warm_up(engine: Any, short: bool) -> None:
    from engine_proc import SamplingParams

    prompt, tokens = (SHORT_WARMUP, 4) if short else (WARMUP_PROMPT, WARMUP_TOKENS)
    assert not short or len(prompt) + tokens < engine.block_size
    engine.generate([prompt], SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    if not short:
        engine.reset_prefix_cache()


def run_kvscope(system: str, workload: dict, args: argparse.Namespace) -> dict:
    meta = workload.get("meta", {})
    tiered = "tier_blocks" in meta  # the tier workloads: every system warms up alike
    disk_dir = tempfile.mkdtemp(prefix="kvscope-bench-kv-") if system == "kvscope-disk" else None
    try:
        t_load = time.monotonic()
        ckpt = load_engine_checkpoint(args.model, args.dtype, args.cache_dir)
        kv_bpt = ckpt.config.kv_bytes_per_token(_itemsize(args.dtype))
        config = engine_config_for(system, workload, args, kv_bpt, disk_dir)
        engine = _build(config, args, ckpt)
        del ckpt
        load_s = time.monotonic() - t_load
        _warm_up(engine, short=tiered)
        reqs = parse_workload(workload)
        extra: dict[str, Any] = {}
        when_idle = None
        if disk_dir is not None:
            # Every disk hit is read from the device, not from pages the OS kept of the files.
            when_idle = partial(drop_page_cache, disk_dir)
            extra["disk_reads"] = "device (page cache dropped before each request)"
        prime = set(meta.get("prime", ()))
        if prime:
            engine, reqs, restart = _prime_and_restart(engine, config, reqs, prime, args)
            extra |= restart
        return _measure(engine, reqs, load_s, when_idle) | extra
    finally:
        if disk_dir is not None:
            shutil.rmtree(disk_dir, ignore_errors=True)


def _itemsize(dtype: str) -> int:
    import torch

    return getattr(torch, dtype).itemsize


def _prime_and_restart(engine: Any, config: Any, reqs: list, prime: set[str],
                       args: argparse.Namespace) -> tuple[Any, list, dict]:
    """Serve the prime requests, shut the engine down as `serve` does (flushing its cached
    blocks down), start a fresh one on the same config (and disk directory)."""
    first = [r for r in reqs if r.id in prime]
    rest = [r for r in reqs if r.id not in prime]
    if not rest or rest[0].arrival_s is None:
        raise ValueError("workload.meta.prime: the requests after the prime ones must start "
                         "with one that has arrival_s (the restarted engine's first)")
    t0, _ = serve(engine, first, Occupancy())
    primed = request_results(first, t0)
    t = time.monotonic()
    flushed = engine.flush_kv_tiers()
    del engine
    gc.collect()
    shutdown_s = time.monotonic() - t
    t = time.monotonic()
    engine = _build(config, args)
    restart_s = time.monotonic() - t
    _warm_up(engine, short=True)
    logger.info("restart: %d blocks flushed in %.2f s, new engine in %.2f s", flushed,
                shutdown_s, restart_s)
    extra = {"prime_requests": primed, "flushed_blocks": flushed, "shutdown_s": shutdown_s,
             "restart_s": restart_s}
    return engine, rest, extra


def _measure(engine: Any, reqs: list, load_s: float,
             when_idle: Callable[[], object] | None) -> dict:
    base = engine.snapshot().counters
    occ = Occupancy()
    t0, served = serve(engine, reqs, occ, when_idle)
    counters = engine.snapshot().counters
    result = summarize(reqs, t0)
    queries = counters["prefix_cache_queries"] - base["prefix_cache_queries"]
    hits = counters["prefix_cache_hits"] - base["prefix_cache_hits"]
    result.update(
        {
            "load_s": load_s,
            "steps": served.steps,
            # Most sequences that advanced in one step: each had its whole context resident.
            "peak_concurrent": served.peak_concurrent,
            "prefix_cache_queries": queries,
            "prefix_cache_hits": hits,
            "prefix_hit_rate": hits / queries if queries else None,
            "num_preemptions": counters["num_preemptions"] - base["num_preemptions"],
            # The warm-up never reaches the tiers: these count the measured run (after a
            # restart: the restarted engine's).
            "tiers": {k: v for k, v in counters.items() if k.startswith(TIER_COUNTER_PREFIXES)},
            "kv": occ.result(),
            "engine_config": engine.live_config()
            | {"num_kv_blocks": engine.num_blocks, "block_size": engine.block_size},
            "model_info": engine.model_info(),
            # fused | building | eager (engine_proc/executor/fused_decode.py), and the steps it ran
            "decode_step": engine.runner.fused.state,
            "decode_detail": engine.runner.fused.detail,  # its kernel, "+int8" on 8-bit activations
            "fused_steps": engine.runner.num_fused_steps,
            "requests": request_results(reqs, t0),
        }
    )
    if engine.config.speculative_config is not None:
        # Drafts proposed and accepted in the measured run (the warm-up's are subtracted).
        result["spec_decode"] = {
            key: counters.get(f"spec_decode_{key}", 0) - base.get(f"spec_decode_{key}", 0)
            for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
        # False where the engine turned speculation off for this model (LLMEngine._speculation)
        result["spec_decode"]["active"] = engine.proposer is not None
    return result
