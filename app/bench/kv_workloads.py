"""The KV-memory workloads of the benchmark (issue 14): lower KV tiers and the int8 KV cache.

Pure functions of (sizes, rng, vocabulary), like every workload (app/bench/workloads.py builds
the JSON around them); the systems they compare are KVScope configurations:

- tiered: `tiered_prompts` distinct system prompts in rotation, one request at a time, each with
  a user turn of its own, over a pool that holds `tiered_pool_prompts` of them (LRU: with more
  prompts in rotation than the pool holds, every request misses the pool). The first rotation
  computes every prompt; the requests after it see a prompt again and are measured: served from
  the host tier, the disk tier, or recomputed.
- restart: `restart_prompts` prompts are run (primed), the engine is shut down (flushing its
  cached blocks down) and a fresh engine on the same disk directory serves the same prompts
  again (measured): disk-warm vs cold (no tiers: everything is recomputed).
- kv-capacity: `kvcap_seqs` sequences at once on a pool of a fixed `kvcap_memory` bytes: the
  peak number the engine runs at once (each with its whole context resident), model dtype vs
  int8.
- kv-decode-4k: one greedy stream decoding at `kv4k_prompt` tokens of context, model dtype vs
  int8, on a pool of `kv4k_memory` bytes.

This module imports nothing from the app (app.bench.workloads imports it).
"""

from __future__ import annotations

import random
from typing import Any, Protocol

TIERED_SYSTEMS = ("kvscope-recompute", "kvscope-host", "kvscope-disk")
RESTART_SYSTEMS = ("kvscope-recompute", "kvscope-disk")
KV_DTYPE_SYSTEMS = ("kvscope", "kvscope-kvint8")
KV_WORKLOADS = ("tiered", "restart", "kv-capacity", "kv-decode-4k")
# `--workloads kv-int8` names both int8 workloads.
KV_GROUPS = {"kv-int8": ("kv-capacity", "kv-decode-4k")}
KV_WORKLOAD_SYSTEMS = {
    "tiered": TIERED_SYSTEMS,
    "restart": RESTART_SYSTEMS,
    "kv-capacity": KV_DTYPE_SYSTEMS,
    "kv-decode-4k": KV_DTYPE_SYSTEMS,
}
BLOCK_SIZE = 16  # the engine's default; the workloads that size a pool pin it
# Slack in the lower tiers beyond the blocks a workload can store (never a capacity limit).
TIER_SLACK_BLOCKS = 8


class Draws(Protocol):
    def draw(self, rng: random.Random, n: int) -> list[int]: ...


def blocks_for(tokens: int, block_size: int = BLOCK_SIZE) -> int:
    return -(-tokens // block_size)


def _chained(rid: str, prompt: list[int], max_tokens: int, prev: str | None) -> dict:
    """A request that arrives when the previous one has finished (the first at t=0)."""
    when: dict[str, Any] = ({"arrival_s": 0.0} if prev is None
                            else {"after": {"request": prev, "tokens": -1}})
    return {"id": rid, "prompt": prompt, "max_tokens": max_tokens, **when}


def tiered(s: Any, rng: random.Random, vocab: Draws) -> tuple[list[dict], dict, dict]:
    """(requests, engine overrides, meta) of the tiered workload."""
    if s.tiered_requests <= s.tiered_prompts:
        raise ValueError(f"tiered_requests must exceed tiered_prompts ({s.tiered_prompts}): "
                         f"only requests after the first rotation see a prompt again")
    if not 1 <= s.tiered_pool_prompts < s.tiered_prompts:
        # LRU over a rotation that fits the pool would hit the pool, never a tier.
        raise ValueError(f"tiered_pool_prompts must be in [1, tiered_prompts = "
                         f"{s.tiered_prompts}), got {s.tiered_pool_prompts}")
    if not 1 <= s.tiered_user < BLOCK_SIZE:
        # A full user block would be stored in the tiers too, and never hit; without a user
        # turn the prompt's last token (always computed) would fall in the system prompt.
        raise ValueError(f"tiered_user must be in [1, {BLOCK_SIZE}) tokens, got {s.tiered_user}")
    prompts = [vocab.draw(rng, s.tiered_len) for _ in range(s.tiered_prompts)]
    reqs, prev = [], None
    for k in range(s.tiered_requests):
        rid = f"t{k}-p{k % s.tiered_prompts}"
        reqs.append(_chained(rid, prompts[k % s.tiered_prompts] + vocab.draw(rng, s.tiered_user),
                             s.tiered_out, prev))
        prev = rid
    per_request = blocks_for(s.tiered_len + s.tiered_user + s.tiered_out)
    engine = {"block_size": BLOCK_SIZE, "num_kv_blocks": s.tiered_pool_prompts * per_request}
    meta = {"system_prompt_tokens": s.tiered_len, "prompts": s.tiered_prompts,
            "pool_prompts": s.tiered_pool_prompts,
            "measured": [r["id"] for r in reqs[s.tiered_prompts:]],
            # The system prompt's full blocks: what a tier can serve a measured request.
            "shareable_tokens": (s.tiered_requests - s.tiered_prompts)
            * (s.tiered_len // BLOCK_SIZE * BLOCK_SIZE),
            "tier_blocks": s.tiered_prompts * per_request + TIER_SLACK_BLOCKS}
    return reqs, engine, meta


def restart(s: Any, rng: random.Random, vocab: Draws) -> tuple[list[dict], dict, dict]:
    """(requests, engine overrides, meta) of the restart workload: prime p<i>, then (in a fresh
    engine) the very same prompt as r<i>."""
    prompts = [vocab.draw(rng, s.restart_len) for _ in range(s.restart_prompts)]
    reqs = []
    for phase in ("p", "r"):  # each phase's first request arrives when its engine is ready
        reqs += [_chained(f"{phase}{i}", prompt, 1, f"{phase}{i - 1}" if i else None)
                 for i, prompt in enumerate(prompts)]
    meta = {"prompt_tokens": s.restart_len,
            "prime": [f"p{i}" for i in range(s.restart_prompts)],
            "measured": [f"r{i}" for i in range(s.restart_prompts)],
            # Full blocks before the last prompt token (which is always computed).
            "shareable_tokens": s.restart_prompts
            * ((s.restart_len - 1) // BLOCK_SIZE * BLOCK_SIZE),
            "tier_blocks": s.restart_prompts * blocks_for(s.restart_len + 1)
            + TIER_SLACK_BLOCKS}
    return reqs, {"block_size": BLOCK_SIZE}, meta


def kv_capacity(s: Any, rng: random.Random, vocab: Draws) -> tuple[list[dict], dict, dict]:
    reqs = [{"id": f"c{i}", "prompt": vocab.draw(rng, s.kvcap_prompt), "max_tokens": s.kvcap_new,
             "arrival_s": 0.0} for i in range(s.kvcap_seqs)]
    # Neither the step's token budget nor the batch cap may be what limits the count.
    engine = {"block_size": BLOCK_SIZE, "kv_cache_memory": s.kvcap_memory,
              "max_num_seqs": max(64, s.kvcap_seqs),
              "max_num_batched_tokens": max(2048, s.kvcap_seqs * s.kvcap_prompt)}
    meta = {"context": s.kvcap_prompt + s.kvcap_new, "kv_cache_memory": s.kvcap_memory}
    return reqs, engine, meta


def kv_decode(s: Any, rng: random.Random, vocab: Draws) -> tuple[list[dict], dict, dict]:
    reqs = [{"id": "d0", "prompt": vocab.draw(rng, s.kv4k_prompt), "max_tokens": s.kv4k_new,
             "arrival_s": 0.0}]
    engine = {"block_size": BLOCK_SIZE, "kv_cache_memory": s.kv4k_memory}
    meta = {"context": s.kv4k_prompt + s.kv4k_new, "kv_cache_memory": s.kv4k_memory}
    return reqs, engine, meta


KV_BUILDERS = {"tiered": tiered, "restart": restart, "kv-capacity": kv_capacity,
               "kv-decode-4k": kv_decode}
