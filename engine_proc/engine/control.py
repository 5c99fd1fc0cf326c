"""LLMEngine's live control and state: scheduler limits, prefix caching, KV cache events and
the lower KV tiers, model info and telemetry snapshots (what the server's controls and its
publishing call). A mixin of LLMEngine (engine_proc/engine/llm_engine.py), which owns the state it
reads."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from engine_proc.config import DEFAULT_PREFILL_CHUNK
from engine_proc.core.kv_events import KVEvent, KVEventLog, full_replay
from engine_proc.core.request import Sequence
from engine_proc.engine.chat_render import reasoning_parser_of, tool_parser_of
from engine_proc.engine.parts import EngineParts
from engine_proc.engine.telemetry import build_snapshot
from engine_proc.engine.telemetry_types import EngineSnapshot

logger = logging.getLogger("engine_proc.engine.llm_engine")


class LiveControl(EngineParts):
    def live_config(self) -> dict[str, int | bool]:
        limits = dataclasses.asdict(self.scheduler.limits)
        default = limits["long_prefill_chunk"] is None
        if default:  # the chunk while others run (a prompt alone takes the whole budget)
            limits["long_prefill_chunk"] = DEFAULT_PREFILL_CHUNK
        return limits | {"enable_prefix_caching": self.kv.enable_caching,
                         "long_prefill_chunk_default": default}  # fmt: skip

    def set_limits(
        self,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        long_prefill_chunk: int | None = None,
        default_prefill_chunk: bool = False,
    ) -> dict[str, int | bool]:
        """None leaves a limit as it is; default_prefill_chunk=True returns long_prefill_chunk
        to the engine's rule (EngineConfig.long_prefill_chunk=None)."""
        if default_prefill_chunk and long_prefill_chunk is not None:
            raise ValueError("give long_prefill_chunk or default_prefill_chunk, not both")
        self.scheduler.set_limits(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            long_prefill_chunk=long_prefill_chunk,
        )
        if default_prefill_chunk:
            limits = self.scheduler.limits
            self.scheduler.limits = dataclasses.replace(limits, long_prefill_chunk=None)
        return self.live_config()

    def set_prefix_caching(self, enabled: bool) -> dict[str, int | bool]:
        if not isinstance(enabled, bool):
            raise ValueError(f"enable_prefix_caching must be true or false, got {enabled!r}")
        self.kv.pool.set_caching(enabled)
        return self.live_config()

    def enable_kv_events(self, log: KVEventLog | None = None) -> None:
        """Record KV cache events (engine_proc/core/kv_events.py) of the pool and the lower tiers
        into one log (a fresh one unless given) for drain_kv_events()."""
        if self.kv.pool.events is None or log is not None:
            log = log or KVEventLog()
            self.kv.pool.events = log
            if self.kv.tiers is not None:
                self.kv.tiers.set_events(log)
            log.queue_replay(self.kv_event_replay())  # whatever is already cached

    def drain_kv_events(self) -> tuple[list[KVEvent], bool]:
        """Events since the last call, and whether a replay had to replace lost ones."""
        log = self.kv.pool.events
        if log is None:
            return [], False
        events, overflowed = log.drain()
        if overflowed:  # the log was not drained in time: describe the index from scratch
            events = self.kv_event_replay()
        return events, overflowed

    def replay_kv_events(self) -> None:
        """Queue a full replay, for subscribers that lost events."""
        if self.kv.pool.events is not None:
            self.kv.pool.events.queue_replay(self.kv_event_replay())

    def kv_event_replay(self) -> list[KVEvent]:
        """AllBlocksCleared for every medium, then every block of the pool and of each lower
        tier, parents first (engine_proc/kv_events.full_replay)."""
        stored = self.kv.pool.stored_events()
        if self.kv.tiers is not None:
            stored += self.kv.tiers.stored_events()
        return full_replay(stored)

    def reset_prefix_cache(self) -> bool:
        dropped = self.kv.pool.reset_prefix_cache()
        if self.kv.tiers is not None:  # the next request recomputes: lower tiers are emptied too
            self.kv.tiers.clear()
        logger.info("prefix cache reset: %d cached blocks dropped", dropped)
        return True

    def flush_kv_tiers(self) -> int:
        """Write every cached pool block down into the lower KV tiers (write-back only stores
        evicted blocks, so a prefix whose first blocks never left the pool would not survive a
        restart); call before shutting down. Returns the number of blocks offered."""
        tiers = self.kv.tiers
        if tiers is None:
            return 0
        cached = [b for b in self.kv.pool.blocks if b.block_hash is not None]
        for block in cached:
            tiers.store(block.block_hash, block.block_id)
        return len(cached)

    def model_info(self) -> dict[str, Any]:
        mc = self.model_config
        tiers = self.kv.tiers
        return {
            "name": self.checkpoint_name,
            "model_id": self.model_id,
            "architecture": mc.architecture,
            "num_layers": mc.num_layers,
            "num_heads": mc.num_heads,
            "num_kv_heads": mc.num_kv_heads,
            "head_dim": mc.head_dim,
            "vocab_size": mc.vocab_size,
            "dtype": self.config.dtype,
            "device": str(self.device),
            "attention_backend": self.backend.name,
            "decode_weights": self.decode_weights,
            "kv_cache_dtype": self.kv_cache_dtype,
            "cache_identity": self.cache_identity,
            # lower KV tiers (engine_proc/kv_store/tiers.py): their capacity in bytes, 0 = no such
            # tier
            "kv_host_bytes": self.config.kv_host_memory if tiers and tiers.host else 0,
            "kv_disk_bytes": tiers.disk.capacity_bytes if tiers and tiers.disk else 0,
            "block_size": self.block_size,
            "num_blocks": self.num_blocks,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            # hybrid KV (engine_proc/core/kv_groups.py): per group its window (None = full
            # attention) and layers; one group of every layer otherwise
            "kv_groups": [{"window": w, "layers": self.kv_layout.layers_of(g)}
                          for g, w in enumerate(self.kv_layout.windows)],  # fmt: skip
            "kv_pool_bytes": self.num_blocks * self.block_bytes,
            "max_model_len": self.max_model_len,
            # how the API reads replies (engine_proc/engine/chat_render.py)
            "tool_parser": tool_parser_of(self.tokenizer),
            "reasoning_parser": reasoning_parser_of(self.tokenizer),
            "cuda_graph_sizes": (
                self.runner.decode_graphs.batch_sizes if self.runner.decode_graphs else []
            ),
        }

    def all_sequences(self) -> list[Sequence]:
        return [s for family in self.requests.values() for s in family if not s.is_finished]

    def snapshot(self) -> EngineSnapshot:
        snap = build_snapshot(
            now=self.clock(),
            stats=self.stats,
            kv=self.kv,
            seqs=self.all_sequences(),
            # with the requests whose grammar is still compiling (not in the scheduler yet)
            num_waiting=len(self.scheduler.waiting) + len(self.structured.parked),
            block_bytes=self.block_bytes,
            contiguous_bytes_per_request=self.max_model_len * self.kv_bytes_per_token,
            live_config=self.live_config(),
        )
        if self.kv.tiers is not None:
            snap.counters.update(self.kv.tiers.counters())
        snap.counters.update(self.transfer.counters())
        if self.config.speculative_config is not None:
            snap.counters.update(self.stats.spec_decode.counters())
        snap.histograms = self.histograms.by_name
        snap.finished_reasons = dict(self.histograms.finished_reasons)
        if self.model.expert_counts is not None:
            snap.expert_counts = self.model.expert_counts.tolist()
        if self.model.device.type == "cpu":  # the fused step is a CPU step: GPUs report none
            snap.decode_step = self.runner.fused.state
            snap.decode_detail = self.runner.fused.detail
        return snap
