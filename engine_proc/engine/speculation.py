"""The engine's speculative decoding: which proposer it runs (speculative_config), which
sequences may speculate, and the draft model's batched run before each step."""

from __future__ import annotations

import logging

from engine_proc.config import EngineConfig, SpeculativeConfig
from engine_proc.core.kv_groups import KVLayout
from engine_proc.core.request import Sequence
from engine_proc.engine.parts import EngineParts
from engine_proc.spec_decode.draft_length import first_draft_length, next_draft_length
from engine_proc.spec_decode.draft_model import DraftModelProposer, check_same_tokenizer
from engine_proc.spec_decode.ngram import NgramProposer
from engine_proc.structured.draft import DraftGrammars

logger = logging.getLogger(__name__)

Proposer = NgramProposer | DraftModelProposer
# After n speculative steps in a row that accepted none of a sequence's drafts, it skips the
# next min(2**(n - 1) - 1, MAX_SKIP) chances to draft: on text its drafts do not predict, a
# proposer (a draft model above all) and the verification of wrong drafts cost time for
# nothing; one accepted draft resets it. Not after one miss: the draft length has halved
# already (draft_length.py), and a lone wrong guess from a two-token match is common in text
# that prompt lookup predicts well a few tokens later (replayed on the spec-ngram prompts, Zen
# 1's step costs: code edit 1.31x with a skip after every miss, 1.39x without it).
MAX_SKIP = 15


class Speculation(EngineParts):
    """Mixin of LLMEngine (the attributes it reads are set in LLMEngine.__init__)."""

    proposer: Proposer | None
    kv_layout: KVLayout

    def _speculation(self, config: EngineConfig) -> Proposer | None:
        spec = config.speculative_config
        if spec is None:
            return None
        assert isinstance(spec, SpeculativeConfig)
        logger.info("speculative decoding: %s", spec)
        if spec.method == "ngram":
            return NgramProposer(
                spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min
            )
        draft = self._draft_engine(config, spec)
        # the drafts of a constrained sequence follow its grammar (xgrammar loads with the first)
        constraints = DraftGrammars(draft.model_config.vocab_size)
        return DraftModelProposer(draft, spec.num_speculative_tokens, constraints)

    def _draft_engine(self, config: EngineConfig, spec: SpeculativeConfig):
        """The draft model's engine: the target's device, dtype, decode step and limits, a pool
        of as many blocks as the target's (as many tokens; a smaller model's take fewer
        bytes), prefix caching on (it is what
        spares recomputing each sequence's history every step), and the fastest decode weights
        it can run ("auto": 4-bit on CPUs), since drafts need not be exact: a full-precision
        target may even take its own 4-bit copy as the draft."""
        assert spec.model is not None
        draft_config = EngineConfig(
            model=spec.model, dtype=config.dtype, device=str(self.device),
            block_size=config.block_size, num_kv_blocks=self.num_blocks,
            max_model_len=self.max_model_len, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            long_prefill_chunk=config.long_prefill_chunk, enable_prefix_caching=True,
            attention_backend=config.attention_backend, cuda_graphs=config.cuda_graphs,
            decode_weights="auto", decode_step=config.decode_step,
            decode_activations=config.decode_activations,
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

    def _may_speculate(self, seq: Sequence) -> bool:
        """Not against its own opt-out. Penalties, logit_bias, logprobs, seeds, structured
        output (each verified row masked by its grammar after the drafts before it,
        structured/mask.py) and n > 1 (after the fork) speculate exactly."""
        return seq.params.speculative

    def _batch_too_wide(self) -> bool:
        limit = self.config.speculative_config.disable_by_batch_size
        return bool(limit) and len(self.scheduler.running) > limit  # see config.py

    def _propose(self, seq: Sequence, k: int) -> list[int]:
        """The scheduler's drafts for seq: at most k, or [] where it may not speculate."""
        proposer = self.proposer
        assert proposer is not None
        k = self._draft_room(seq, k)
        if k <= 0:
            return []
        if isinstance(proposer, DraftModelProposer):
            drafts = proposer.propose(seq, k)  # _prepare_drafts applied the rules below
        elif self._batch_too_wide() or not self._may_speculate(seq) or self._backing_off(seq):
            return []
        else:
            drafts = proposer.propose(seq.token_ids, min(k, self._draft_length(seq)))
        seq.spec_mark = seq.num_tokens if drafts else -1
        seq.spec_drafted = len(drafts)
        return drafts

    def _draft_room(self, seq: Sequence, k: int) -> int:
        """At most k drafts, and under LongRoPE's short factors none whose row would sample
        past the original length: plain decoding samples that token only after recomputing
        the sequence under the long factors (scheduler.py), so the drafts stop short of it."""
        original = self.scheduler.longrope_original
        if original is None or seq.rope_long:
            return k
        return max(0, min(k, original - seq.num_tokens))

    def _draft_length(self, seq: Sequence) -> int:
        """How many drafts seq proposes now (spec_decode/draft_length.py)."""
        assert self.proposer is not None
        if seq.spec_length == 0:
            seq.spec_length = first_draft_length(self.proposer.num_speculative_tokens)
        return seq.spec_length

    def _backing_off(self, seq: Sequence) -> bool:
        """Whether seq skips this chance to draft (MAX_SKIP), after learning from its tokens
        how its last drafts fared (its misses and its draft length): a step that accepted a of
        them added a + 1 tokens."""
        assert self.proposer is not None
        if seq.spec_mark >= 0 and seq.num_tokens > seq.spec_mark:  # that step ran
            accepted = seq.num_tokens - seq.spec_mark - 1
            if accepted > 0:
                seq.spec_misses = 0
            else:
                seq.spec_misses += 1
                seq.spec_skip = min(2 ** (seq.spec_misses - 1) - 1, MAX_SKIP)
            seq.spec_length = next_draft_length(self._draft_length(seq), seq.spec_drafted,
                                                min(accepted, seq.spec_drafted),
                                                self.proposer.num_speculative_tokens)
        seq.spec_mark = -1
        if seq.spec_skip > 0:
            seq.spec_skip -= 1
            return True
        return False

    def _prepare_drafts(self) -> None:
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
            if not self._may_speculate(seq) or self._backing_off(seq):
                continue
            k = self._draft_room(seq, min(seq.params.max_tokens - seq.num_output_tokens - 1,
                                          seq.max_total_tokens - seq.num_tokens - 1,
                                          self._draft_length(seq)))
            wanted.append((seq, k))
        proposer.prepare(wanted, self.scheduler.running)

    def _forget_drafts(self, seq: Sequence) -> None:
        if isinstance(self.proposer, DraftModelProposer):
            self.proposer.forget(seq)
