"""The engine's speculative decoding: which proposer it runs (speculative_config), which
sequences may speculate, and the draft model's batched run before each step."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from engine_proc.config import EngineConfig, SpeculativeConfig
from engine_proc.core.request import Sequence
from engine_proc.spec_decode.draft_model import DraftModelProposer, check_same_tokenizer
from engine_proc.spec_decode.ngram import NgramProposer

if TYPE_CHECKING:
    from engine_proc.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

Proposer = NgramProposer | DraftModelProposer


def longrope_original(config) -> int | None:
    """LongRoPE's original_max_position_embeddings (Phi-3), past which a sequence rotates with
    the long factors; None for other rotary embeddings."""
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type") != "longrope":
        return None
    return int(scaling["original_max_position_embeddings"])


class Speculation:
    """Mixin of LLMEngine (the attributes it reads are set in LLMEngine.__init__)."""

    def _speculation(self: LLMEngine, config: EngineConfig) -> Proposer | None:
        spec = config.speculative_config
        if spec is None:
            return None
        assert isinstance(spec, SpeculativeConfig)
        # Not built yet: rolling back the drafts' K/V in a hybrid cache's sliding groups, and
        # drafts that cross LongRoPE's switch to the long factors.
        lacks = [what for present, what in (
            (self.kv_layout.is_hybrid, "a hybrid KV cache (sliding-window groups)"),
            (longrope_original(self.model_config) is not None, "LongRoPE"),
        ) if present]  # fmt: skip
        if lacks:
            logger.warning("speculative decoding is off: %s has %s",
                           self.model_config.architecture, " and ".join(lacks))  # fmt: skip
            return None
        logger.info("speculative decoding: %s", spec)
        if spec.method == "ngram":
            return NgramProposer(
                spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min
            )
        return DraftModelProposer(self._draft_engine(config, spec), spec.num_speculative_tokens)

    def _draft_engine(self: LLMEngine, config: EngineConfig, spec: SpeculativeConfig):
        """The draft model's engine: the target's device, dtype, decode path and limits, a pool
        of the same bytes (a smaller model's tokens take fewer), prefix caching on (it is what
        spares recomputing each sequence's history every step)."""
        assert spec.model is not None
        draft_config = EngineConfig(
            model=spec.model, dtype=config.dtype, device=str(self.device),
            block_size=config.block_size, kv_cache_memory=config.kv_cache_memory,
            max_model_len=self.max_model_len, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            long_prefill_chunk=config.long_prefill_chunk, enable_prefix_caching=True,
            attention_backend=config.attention_backend, cuda_graphs=config.cuda_graphs,
            decode_weights=config.decode_weights, decode_step=config.decode_step,
        )  # fmt: skip
        try:
            draft = type(self)(draft_config)
        except (OSError, ValueError) as exc:
            raise ValueError(f"speculative_config: the draft model {spec.model!r} does not "
                             f"load: {exc}") from exc  # fmt: skip
        check_same_tokenizer(self.tokenizer, draft.tokenizer, spec.model)
        logger.info("draft model %s: %d layers, %d B of KV per token",
                    draft.checkpoint_name, draft.model_config.num_layers,
                    draft.kv_bytes_per_token)  # fmt: skip
        return draft

    def _may_speculate(self: LLMEngine, seq: Sequence) -> bool:
        """Not for its own opt-out, nor structured output (its grammar state would have to roll
        back with the rejected drafts). Penalties, logit_bias, logprobs, seeds and n > 1 (after
        the fork) speculate exactly."""
        return seq.params.speculative and seq.params.structured is None

    def _batch_too_wide(self: LLMEngine) -> bool:
        limit = self.config.speculative_config.disable_by_batch_size
        return bool(limit) and len(self.scheduler.running) > limit  # see config.py

    def _propose(self: LLMEngine, seq: Sequence, k: int) -> list[int]:
        """The scheduler's drafts for seq: at most k, or [] where it may not speculate."""
        assert self.proposer is not None
        if self._batch_too_wide() or not self._may_speculate(seq):
            return []
        return self.proposer.propose(seq.token_ids, k) if isinstance(
            self.proposer, NgramProposer) else self.proposer.propose(seq, k)  # fmt: skip

    def _prepare_drafts(self: LLMEngine) -> None:
        """A draft model's drafts for every running sequence about to decode, in one batched
        run of the draft engine before the scheduler asks for them one by one."""
        proposer = self.proposer
        if not isinstance(proposer, DraftModelProposer):
            return
        if self._batch_too_wide():
            proposer.drafts.clear()
            return
        wanted = []
        for seq in self.scheduler.running:
            if seq.num_tokens - seq.num_computed_tokens != 1 or seq.num_forks > 1:
                continue  # prefilling, or about to fork (no drafts before the fork)
            if not self._may_speculate(seq):
                continue
            k = min(seq.params.max_tokens - seq.num_output_tokens - 1,
                    seq.max_total_tokens - seq.num_tokens - 1)  # fmt: skip
            wanted.append((seq, k))
        proposer.prepare(wanted)
