"""Shapes of the engine's live state, as `LLMEngine.snapshot()` returns them.

Plain Python and numpy only, so the server can pack them for the wire without touching torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Block states, as stored in BlockSnapshot.state
BLOCK_EMPTY = 0  # never used, or freed with no prefix hash
BLOCK_CACHED = 1  # free (reference count 0) but holding a prefix hash: evictable, can be hit
BLOCK_IN_USE = 2  # referenced by at least one running request


@dataclass(slots=True)
class BlockSnapshot:
    state: np.ndarray  # uint8 [num_blocks], BLOCK_* above
    ref_count: np.ndarray  # int32 [num_blocks]
    filled: np.ndarray  # int32 [num_blocks], token slots holding computed K/V
    short_hash: np.ndarray  # uint32 [num_blocks], first 4 bytes of the prefix hash, 0 = none
    parent: np.ndarray  # int32 [num_blocks], block holding the previous block of the chain, -1


@dataclass(slots=True)
class RequestSnapshot:
    request_id: str
    status: str  # waiting | running | preempted | finished
    block_table: list[int]
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache (last admission)
    num_computed_tokens: int
    num_generated_tokens: int
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    # hybrid KV: the sliding groups' tables, -1 where a block left the window
    group_tables: list[list[int]] = field(default_factory=list)
    structured: str = ""  # the constraint's kind (json, regex, ...); "" for none
    num_tools: int = 0  # tools its chat offered the model
    # tokens the grammar allowed at each of its last steps (at most 256), oldest first
    allowed_tokens: list[int] = field(default_factory=list)
    # speculative decoding: its latest speculative step since the previous snapshot (drafts at
    # positions draft_start.., the block of each, the first draft_accepted confirmed; [] for
    # none), and its drafts verified / confirmed so far
    draft_start: int = 0
    draft_blocks: list[int] = field(default_factory=list)
    draft_accepted: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass(slots=True)
class TokenEvent:
    request_id: str
    index: int  # 0 = first output token
    time: float  # engine monotonic clock, seconds


@dataclass(slots=True)
class StepStats:
    time: float  # end of step, engine monotonic clock
    duration: float
    num_prefill_tokens: int
    num_decode_tokens: int
    num_running: int
    num_waiting: int


@dataclass(slots=True)
class EngineSnapshot:
    time: float
    blocks: BlockSnapshot
    requests: list[RequestSnapshot]
    counters: dict[str, float]
    config: dict[str, int | bool]  # the live limits and prefix-caching switch
    token_events: list[TokenEvent] = field(default_factory=list)  # since the previous snapshot
    steps: list[StepStats] = field(default_factory=list)  # since the previous snapshot
    # Cumulative since start: engine_proc.engine.metrics.Histogram by name, finishes by reason.
    histograms: dict[str, Any] = field(default_factory=dict)
    finished_reasons: dict[str, int] = field(default_factory=dict)
    # Routed-experts models: tokens routed to each expert, [layer][expert], cumulative since
    # load (rows of dense layers 0); empty for models without experts.
    expert_counts: list[list[int]] = field(default_factory=list)
    # The CPU decode step (engine_proc/executor/fused_decode.py FusedDecode): "fused",
    # "building" (eager while it compiles) or "eager"; its detail: the 4-bit kernel, where it
    # is built ("here" / "elsewhere") or why eager. "" from engines without it (GPUs).
    decode_step: str = ""
    decode_detail: str = ""
