"""Counters and timings the engine keeps, and the snapshot of its live state the monitor draws."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from engine_proc.core.kv_cache_manager import KVCacheManager
from engine_proc.core.request import Sequence
from engine_proc.engine.telemetry_types import (
    BLOCK_CACHED,
    BLOCK_IN_USE,
    BlockSnapshot,
    EngineSnapshot,
    RequestSnapshot,
    StepStats,
    TokenEvent,
)
from engine_proc.spec_decode.verify import SpecDecodeStats

_MAX_EVENTS = 1 << 16  # bounded: nobody may make the engine hold unbounded history


@dataclass(slots=True)
class EngineStats:
    prompt_tokens_total: int = 0  # prompt tokens computed (cache hits excluded)
    request_prompt_tokens_total: int = 0  # prompt tokens of the requests added (as received)
    generation_tokens_total: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_requests_finished: int = 0
    spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    token_events: deque[TokenEvent] = field(default_factory=lambda: deque(maxlen=_MAX_EVENTS))
    steps: deque[StepStats] = field(default_factory=lambda: deque(maxlen=_MAX_EVENTS))


def block_snapshot(kv: KVCacheManager, seqs: list[Sequence]) -> BlockSnapshot:
    pool = kv.pool
    n = pool.num_blocks
    ref_count = np.fromiter((b.ref_count for b in pool.blocks), dtype=np.int32, count=n)
    hashed = [b for b in pool.blocks if b.block_hash is not None]
    short_hash = np.zeros(n, dtype=np.uint32)
    parent = np.full(n, -1, dtype=np.int32)
    filled = np.zeros(n, dtype=np.int32)
    for b in hashed:
        short_hash[b.block_id] = int.from_bytes(b.block_hash[:4], "big") or 1
        parent[b.block_id] = b.parent
        filled[b.block_id] = kv.block_size  # only full blocks are ever hashed
    bs = kv.block_size
    for seq in seqs:
        # Blocks before the one holding the next token are full; only that one is partial.
        full, partial = divmod(seq.num_computed_tokens, bs)
        for table in (seq.block_table, *seq.group_tables):
            live = [b for b in table[:full] if b >= 0]
            filled[live] = bs
            if partial and full < len(table) and table[full] >= 0:
                filled[table[full]] = max(filled[table[full]], partial)
    state = np.zeros(n, dtype=np.uint8)
    state[short_hash != 0] = BLOCK_CACHED
    state[ref_count > 0] = BLOCK_IN_USE
    return BlockSnapshot(state, ref_count, filled, short_hash, parent)


def request_snapshot(seq: Sequence) -> RequestSnapshot:
    m = seq.metrics
    # A speculative step shows in one snapshot (the next) and is then forgotten: the block map
    # marks what the last step drafted and rolled back, not a history of it. Preempted, a
    # sequence's blocks are gone and so is the mark.
    spec, seq.last_spec = seq.last_spec, None
    if spec is not None and (seq.status.value != "running" or not seq.block_table):
        spec = None
    return RequestSnapshot(
        request_id=seq.display_id,
        status=seq.status.value,
        block_table=list(seq.block_table),
        group_tables=[list(t) for t in seq.group_tables],
        num_prompt_tokens=seq.num_prompt_tokens,
        num_cached_tokens=seq.num_cached_tokens,
        num_computed_tokens=seq.num_computed_tokens,
        num_generated_tokens=seq.num_output_tokens,
        arrival_time=m.arrival_time,
        first_scheduled_time=m.first_scheduled_time,
        first_token_time=m.first_token_time,
        structured=seq.params.structured.kind if seq.params.structured is not None else "",
        num_tools=seq.num_tools,
        allowed_tokens=list(seq.grammar.allowed) if seq.grammar is not None else [],  # type: ignore[attr-defined]
        draft_start=spec.start if spec is not None else 0,
        draft_blocks=list(spec.blocks) if spec is not None else [],
        draft_accepted=spec.accepted if spec is not None else 0,
        num_draft_tokens=seq.num_draft_tokens,
        num_accepted_tokens=seq.num_accepted_tokens,
    )


def counters(
    stats: EngineStats,
    blocks: BlockSnapshot,
    block_size: int,
    num_running: int,
    num_waiting: int,
    block_bytes: int,
    contiguous_bytes_per_request: int,
) -> dict[str, float]:
    in_use_mask = blocks.state == BLOCK_IN_USE
    in_use = int(in_use_mask.sum())
    cached = int((blocks.state == BLOCK_CACHED).sum())
    total = len(blocks.state)
    slots_filled = int(blocks.filled[in_use_mask].sum())
    return {
        "prompt_tokens_total": stats.prompt_tokens_total,
        "request_prompt_tokens_total": stats.request_prompt_tokens_total,
        "generation_tokens_total": stats.generation_tokens_total,
        "prefix_cache_queries": stats.prefix_cache_queries,
        "prefix_cache_hits": stats.prefix_cache_hits,
        "num_preemptions": stats.num_preemptions,
        "num_requests_running": num_running,
        "num_requests_waiting": num_waiting,
        "num_requests_finished": stats.num_requests_finished,
        "kv_cache_usage_perc": in_use / total,
        "num_blocks_total": total,
        "num_blocks_in_use": in_use,
        "num_blocks_cached": cached,
        "num_blocks_empty": total - in_use - cached,
        "kv_token_occupancy": slots_filled / (in_use * block_size) if in_use else 0.0,
        "kv_pool_bytes": total * block_bytes,
        "kv_bytes_in_use": in_use * block_bytes,
        "contiguous_kv_bytes": num_running * contiguous_bytes_per_request,
        "block_size": block_size,
    }


def group_block_counts(seqs: list[Sequence], windows: tuple[int | None, ...]) -> dict[str, float]:
    """A KV cache's blocks by the attention type of the tables holding them (`windows`: per
    group, None = full attention): a full-attention table's blocks grow with the context, a
    sliding group's stay within its window. Distinct block ids (a prefix shared by n > 1 forks
    counts once)."""
    full: set[int] = set()
    sliding: set[int] = set()
    for seq in seqs:
        for window, table in zip(windows, (seq.block_table, *seq.group_tables), strict=False):
            (full if window is None else sliding).update(table)
    full.discard(-1)
    sliding.discard(-1)
    return {"kv_blocks_full_attention": len(full), "kv_blocks_sliding_window": len(sliding)}


def build_snapshot(
    now: float,
    stats: EngineStats,
    kv: KVCacheManager,
    seqs: list[Sequence],
    num_waiting: int,
    block_bytes: int,
    contiguous_bytes_per_request: int,
    live_config: dict[str, int | bool],
) -> EngineSnapshot:
    blocks = block_snapshot(kv, seqs)
    num_running = sum(1 for s in seqs if s.status.value == "running")
    c = counters(
        stats,
        blocks,
        kv.block_size,
        num_running,
        num_waiting,
        block_bytes,
        contiguous_bytes_per_request,
    )
    if any(w is not None for w in kv.windows):
        c.update(group_block_counts(seqs, kv.windows))
    events = list(stats.token_events)
    stats.token_events.clear()
    steps = list(stats.steps)
    stats.steps.clear()
    return EngineSnapshot(
        time=now,
        blocks=blocks,
        requests=[request_snapshot(s) for s in seqs],
        counters=c,
        config=dict(live_config),
        token_events=events,
        steps=steps,
    )
