"""Token-budget scheduler without prefill or decode phases (the vLLM v1 idea): every sequence has
computed and total tokens, and each step hands out at most max_num_batched_tokens of work,
running sequences first, then waiting ones in arrival order. Long prompts are chunked; when
blocks run out the most recently started sequence is preempted and recomputed later.

LongRoPE (Phi-3, `longrope_original`): a sequence longer than original_max_position_embeddings
is rotated with the long factors at every position, as transformers does; one that grows past
that length while decoding is recomputed once (as a preemption) under the long factors, as
transformers' Phi-3 generate() re-encodes it, with a prefix-hash root of its own."""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine_proc.config import DEFAULT_PREFILL_CHUNK, check_limits
from engine_proc.core.kv_cache_manager import KVCacheManager, longrope_root
from engine_proc.core.request import Sequence, SequenceStatus


@dataclass(slots=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    # 0 = no per-prompt cap below the token budget; None: DEFAULT_PREFILL_CHUNK unless the
    # prompt is alone (EngineConfig.long_prefill_chunk)
    long_prefill_chunk: int | None


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache this step
    prefix_cache_hits: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class Scheduler:
    def __init__(self, kv: KVCacheManager, limits: SchedulerLimits,
                 longrope_original: int | None = None) -> None:  # fmt: skip
        self.kv = kv
        self.limits = limits
        self.longrope_original = longrope_original
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is preempted first
        # Speculative decoding: (sequence, at most k) -> drafts to verify after its last token;
        # None = off. The engine's callable decides which sequences may speculate.
        self.propose: Callable[[Sequence, int], list[int]] | None = None

    def set_limits(self, **changes: int | None) -> None:
        new = {k: v for k, v in changes.items() if v is not None}
        merged = dataclasses.asdict(self.limits) | new
        check_limits(**merged)
        self.limits = SchedulerLimits(**merged)

    def add(self, seq: Sequence) -> None:
        if not seq.block_table and not seq.held_blocks:  # (blocks adopted: as they were made)
            self._switch_rope(seq)
        self.waiting.append(seq)

    def _outgrew_short_rope(self, seq: Sequence) -> bool:
        original = self.longrope_original
        return original is not None and not seq.rope_long and seq.num_tokens > original

    def _switch_rope(self, seq: Sequence) -> None:
        """A sequence without K/V past LongRoPE's original length: the long factors from now
        on, under their own prefix hashes."""
        if self._outgrew_short_rope(seq):
            assert not seq.block_table, "switch the rotary factors of a sequence with no blocks"
            seq.rope_long = True
            seq.root_hash = longrope_root(seq.root_hash)
            seq.block_hashes = []

    def add_forked(self, seq: Sequence) -> None:
        """A sequence forked from a running parent: it runs from the next step on."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.limits.max_num_batched_tokens
        while len(self.running) > self.limits.max_num_seqs:  # the cap was lowered live
            self._preempt(self.running.pop(), batch)
        budget = self._schedule_running(batch, budget)
        if not batch.preempted:
            self._schedule_waiting(batch, budget)
        assert batch.num_tokens <= self.limits.max_num_batched_tokens
        assert len(batch.seqs) <= self.limits.max_num_seqs
        return batch

    def _chunk(self, seq: Sequence, remaining: int, budget: int, alone: bool,
               cached: list) -> int:  # fmt: skip
        """The tokens of seq's prompt this step; `alone`: nothing else runs or waits, so the
        default rule gives it the whole budget where the pool has room for that at once."""
        cap = self.limits.long_prefill_chunk
        if cap is None:
            cap = DEFAULT_PREFILL_CHUNK
            whole = min(remaining, budget)
            if alone and whole > cap and self.kv.can_allocate(seq, whole, cached):
                cap = whole
        return min(remaining, cap or remaining, budget)

    def _fit(self, seq: Sequence, n: int, cached: list) -> int:
        """The most of seq's next n tokens the pool has blocks for now (0: none). A chunk that
        does not fit while nothing else runs would wait forever: a chunk size raised live past
        what max_total_tokens was sized for, under a sliding window that holds its chunk."""
        low, high = 0, n
        while low < high:
            mid = (low + high + 1) // 2
            if self.kv.can_allocate(seq, mid, cached):
                low = mid
            else:
                high = mid - 1
        return low

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if self._outgrew_short_rope(seq):  # its K/V again, under the long factors
                self._preempt(self.running.pop(i), batch)
                continue
            self.kv.trim(seq)  # a hybrid cache's sliding groups: blocks out of the window
            alone = len(self.running) == 1 and not self.waiting
            n = self._chunk(seq, seq.num_tokens - seq.num_computed_tokens, budget, alone, [])
            if n > 1 and len(self.running) == 1 and not self.kv.can_allocate(seq, n, []):
                n = max(1, self._fit(seq, n, []))  # no one else could free blocks for it
            later = len(self.running) - i - 1  # sequences still to schedule this step
            seq.spec_token_ids = self._drafts(seq, budget, later) if n == 1 else []
            n += len(seq.spec_token_ids)
            while not self.kv.can_allocate(seq, n, []):
                victim = self.running.pop()
                self._preempt(victim, batch)
                if victim is seq:
                    break
            else:
                self._add_to_batch(batch, seq, n, self.kv.allocate(seq, n, []))
                budget -= n
                i += 1
        return budget

    def _drafts(self, seq: Sequence, budget: int, later: int) -> list[int]:
        """Drafts for a decoding sequence, as many as its token budget, max_tokens and context
        limit leave room for (the step emits up to one more token than it verifies), and only
        where their blocks are free with a block to spare for each of the `later` sequences
        still to schedule: drafts do not preempt (a later prompt chunk needing several blocks
        still can, as another sequence's decode could)."""
        if self.propose is None or seq.num_tokens - seq.num_computed_tokens != 1:
            return []
        if seq.num_forks > 1:  # forks when its first token is sampled: no drafts before
            return []
        k = min(
            budget - 1,
            seq.params.max_tokens - seq.num_output_tokens - 1,
            seq.max_total_tokens - seq.num_tokens - 1,
        )
        if k <= 0:
            return []
        drafts = self.propose(seq, k)
        assert len(drafts) <= k, (len(drafts), k)
        need = self.kv.blocks_needed(seq, 1 + len(drafts), []) if drafts else 0
        if need + later > self.kv.pool.num_free:
            return []
        return drafts

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            # A request that will fork into n sequences reserves their places at admission,
            # unless nothing runs (so a large n can never starve).
            if self.running and len(self.running) + seq.num_forks > self.limits.max_num_seqs:
                break
            cached = self.kv.find_cached_prefix(seq)
            num_cached = len(cached) * self.kv.block_size
            alone = not self.running and len(self.waiting) == 1
            n = self._chunk(seq, seq.num_tokens - num_cached, budget, alone, cached)
            if not self.kv.can_allocate(seq, n, cached):
                if self.running:  # they free blocks as they finish
                    break
                n = self._fit(seq, n, cached)  # nothing runs: a smaller chunk, or none ever
                if n == 0:
                    break
            self.waiting.popleft()
            if self.kv.enable_caching:
                batch.prefix_cache_queries += seq.num_tokens
                batch.prefix_cache_hits += num_cached
            seq.num_cached_tokens = num_cached
            seq.spec_token_ids = []
            self.kv.count_external(seq, num_cached)
            copies = self.kv.allocate(seq, n, cached)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._add_to_batch(batch, seq, n, copies)
            budget -= n

    def _add_to_batch(
        self, batch: ScheduledBatch, seq: Sequence, n: int, copies: list[tuple[int, int]]
    ) -> None:
        batch.seqs.append(seq)
        batch.num_new_tokens.append(n)
        batch.block_copies.extend(copies)
        if seq.is_prefilling:
            batch.num_prefill_tokens += n
        else:
            batch.num_decode_tokens += n

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        # Recompute, not swap: blocks go back to the pool with their hashes, so the sequence
        # usually hits its own blocks when it is admitted again.
        if seq in batch.seqs:
            raise AssertionError("preempting a sequence already scheduled this step")
        self.kv.free(seq)
        self._switch_rope(seq)
        seq.spec_token_ids = []
        seq.last_spec = None  # its blocks are gone: telemetry must not mark them as its drafts
        seq.status = SequenceStatus.PREEMPTED
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)

    def remove(self, seq: Sequence, keep_hashes_below: int | None = None) -> None:
        """Take a finished or aborted sequence out of the queues and free its blocks (hashes of
        blocks from `keep_hashes_below` on are dropped: their K/V was never written)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.block_table or seq.group_tables:
            self.kv.free(seq, keep_hashes_below=keep_hashes_below)
