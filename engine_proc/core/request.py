"""State of one sequence: the unit the scheduler and KV cache manager work on. A request with
n > 1 forks into n sequences sharing the prompt's blocks after its prompt has been computed."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine_proc.detokenizer import IncrementalDetokenizer
from engine_proc.outputs import RequestMetrics
from engine_proc.sampling_params import SamplingParams


@dataclass(slots=True)
class SpecStep:
    """A sequence's latest speculative step, kept for the next telemetry snapshot (which takes
    it): its drafts sat at positions start .. start + len(blocks) - 1, each slot in the physical
    block listed (noted before the rollback, which may free the last of them), and the first
    `accepted` were confirmed; the K/V of the rest was rolled back."""

    start: int
    blocks: list[int]
    accepted: int


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    index: int
    token_ids: list[int]  # prompt followed by output
    num_prompt_tokens: int
    params: SamplingParams
    seed: int  # sampling noise is drawn from (seed, output position)
    detokenizer: IncrementalDetokenizer
    metrics: RequestMetrics
    root_hash: bytes  # start of the prefix-hash chain: model identity and cache salt
    max_total_tokens: int  # the context limit this sequence may grow to
    eos_token_ids: frozenset[int]
    num_forks: int = 1  # sequences still to be forked when the first token is sampled
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    # LongRoPE (Phi-3): its K/V rotated with the long factors, as transformers does for a
    # sequence past original_max_position_embeddings (engine_proc/core/scheduler.py)
    rope_long: bool = False
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at last admission
    num_external_cached_tokens: int = 0  # of those, loaded from the host/disk tiers (pending)
    block_table: list[int] = field(default_factory=list)
    # Hybrid KV (engine_proc/core/kv_groups.py): the sliding groups' tables, group 1 first; -1
    # marks a block released after it left the window.
    group_tables: list[list[int]] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of full blocks, grown lazily
    finish_reason: str | None = None
    error: str | None = None
    # Disaggregation (engine_proc/kv_transfer/transfer.py): lease the prompt's blocks when it
    # finishes (prefill role); blocks adopted from a prefill engine, held until admission (decode
    # role).
    lease_on_finish: bool = False
    held_blocks: list = field(default_factory=list)
    # Structured output (engine_proc/structured/matcher.py's SeqGrammar): where this sequence
    # is in its grammar; None for unconstrained sequences.
    grammar: object | None = None
    num_tools: int = 0  # tools its chat offered the model (telemetry marks agents' requests)
    # Speculative decoding: the drafts scheduled this step after the last token (their K/V is
    # computed with it, and kept only for those the target model confirms); [] otherwise.
    spec_token_ids: list[int] = field(default_factory=list)
    # Backing off where drafts keep failing (engine/speculation.py): num_tokens when it last
    # drafted (-1: not since it was checked), speculative steps in a row that accepted
    # nothing, and chances to skip before the next drafts.
    spec_mark: int = -1
    spec_misses: int = 0
    spec_skip: int = 0
    # Its draft length (spec_decode/draft_length.py; 0: not drafted yet) and how many drafts
    # the step at spec_mark proposed.
    spec_length: int = 0
    spec_drafted: int = 0
    # ... and what became of them: drafts verified and confirmed over the sequence's life (its
    # Finish reports them), and its latest speculative step until a snapshot shows it once.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    last_spec: SpecStep | None = None

    @property
    def display_id(self) -> str:
        """The request id, with "#index" for the extra sequences of an n > 1 request."""
        return self.request_id if self.index == 0 else f"{self.request_id}#{self.index}"

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_prefilling(self) -> bool:
        return self.num_tokens - self.num_computed_tokens > 1

    def append_token(self, token_id: int, now: float) -> None:
        self.token_ids.append(token_id)
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        self.metrics.token_times.append(now)

    def check_stop(self, text_matched_stop: bool) -> str | None:
        """Finish reason after the newest token, or None to keep going."""
        last = self.token_ids[-1]
        if text_matched_stop or last in self.params.stop_token_ids:
            return "stop"
        if not self.params.ignore_eos and last in self.eos_token_ids:
            return "stop"
        if (
            self.num_output_tokens >= self.params.max_tokens
            or self.num_tokens >= self.max_total_tokens
        ):
            return "length"
        return None
