"""LLMEngine's step outputs: sample the step's logits, fork n > 1 requests once their prompt is
computed, finish sequences (stop, error, abort) and build the RequestOutputs a step returns.
A mixin of LLMEngine (engine_proc/engine/llm_engine.py), which owns the state it reads."""

from __future__ import annotations

from typing import Any

import torch

from engine_proc.core.request import Sequence, SequenceStatus, SpecStep
from engine_proc.core.scheduler import ScheduledBatch
from engine_proc.detokenizer import IncrementalDetokenizer
from engine_proc.engine.parts import EngineParts
from engine_proc.engine.telemetry_types import TokenEvent
from engine_proc.executor.sampler import RawLogprobs, compute_logprobs, sample
from engine_proc.outputs import RequestMetrics, RequestOutput, TokenLogprobs
from engine_proc.spec_decode.verify import num_accepted


class StepOutputs(EngineParts):
    def _sample_and_emit(
        self, logits: torch.Tensor, sampling: list[Sequence]
    ) -> list[RequestOutput]:
        if not sampling:
            return []
        # One logits row per sequence (repeated for the forks of an n > 1 request), or 1 + k
        # for a speculative one: a row per position it verifies.
        rows: list[int] = []
        seqs: list[Sequence] = []  # per sampled row
        drafted: list[int] = []  # per sampled row: how many drafts precede it in its sequence
        offset = 0
        for seq in sampling:
            k = len(seq.spec_token_ids)
            family = [seq] + (self._fork(seq) if seq.num_forks > 1 else [])
            assert k == 0 or len(family) == 1, "drafts before a fork"
            rows.extend([offset] * len(family) if k == 0 else range(offset, offset + 1 + k))
            seqs.extend(family * (1 + k))
            drafted.extend([0] * len(family) if k == 0 else range(1 + k))
            offset += 1 + k
        assert offset == logits.shape[0], (offset, logits.shape)
        if rows != list(range(offset)):
            logits = logits[torch.tensor(rows, device=logits.device)]
        params = [s.params for s in seqs]
        grammars: list[Any] = [s.grammar for s in seqs]  # SeqGrammar or None
        chosen_from = logits
        if any(g is not None for g in grammars):
            # Sample from masked logits. The runner's logits are this step's own tensor, so they
            # are masked in place, unless a constrained row wants log-probabilities: those stay
            # the raw logits' (PROTOCOL.md), and a copy is masked instead.
            pairs = zip(grammars, params, strict=True)
            if any(g is not None and p.logprobs is not None for g, p in pairs):
                chosen_from = logits.clone()
            # xgrammar loads with the first grammar: engines that never see one skip its import
            from engine_proc.structured.mask import apply_grammar_masks

            apply_grammar_masks(chosen_from, grammars,
                                [s.spec_token_ids[:j] for s, j in zip(seqs, drafted, strict=True)])
        tokens = sample(
            chosen_from,
            params,
            [s.seed for s in seqs],
            [s.num_output_tokens + j for s, j in zip(seqs, drafted, strict=True)],
            [_history(s, j) for s, j in zip(seqs, drafted, strict=True)],
            [s.num_prompt_tokens for s in seqs],
        )
        logprobs = compute_logprobs(logits, [p.logprobs for p in params], tokens)
        now = self.clock()
        outputs = []
        i = 0
        while i < len(seqs):
            seq = seqs[i]
            drafts = seq.spec_token_ids
            sampled = tokens[i : i + 1 + len(drafts)]
            accepted = num_accepted(drafts, sampled) if drafts else 0
            emit = sampled[: accepted + 1]
            num_known = seq.num_tokens
            if drafts:
                self.stats.spec_decode.observe(len(drafts), accepted)
                self._note_spec(seq, num_known, len(drafts), accepted)
            out = self._emit(seq, emit, logprobs[i : i + len(emit)], now)
            if drafts and not seq.is_finished:
                self.kv.rollback(seq, num_known)
            seq.spec_token_ids = []
            outputs.append(out)
            i += 1 + len(drafts)
        return outputs

    def _note_spec(self, seq: Sequence, start: int, num_drafts: int, accepted: int) -> None:
        """Count a speculative step on the sequence (its Finish reports the totals) and note
        where its drafts' K/V went, before _emit can free the blocks (a finished sequence) or
        the rollback the blocks only rejected drafts filled."""
        seq.num_draft_tokens += num_drafts
        seq.num_accepted_tokens += accepted
        bs = self.block_size
        blocks = [seq.block_table[p // bs] for p in range(start, start + num_drafts)]
        seq.last_spec = SpecStep(start, blocks, accepted)

    def _emit(
        self, seq: Sequence, tokens: list[int], raws: list[RawLogprobs | None], now: float
    ) -> RequestOutput:
        """Append a step's tokens to seq in order, up to the first that finishes it (those
        after are dropped); its output for the step."""
        emitted: list[int] = []
        reason = None
        for token in tokens:
            seq.append_token(token, now)
            emitted.append(token)
            grammar_done = False
            if seq.grammar is not None:
                seq.grammar.accept(token)  # type: ignore[attr-defined]
                grammar_done = seq.grammar.is_terminated  # type: ignore[attr-defined]
            self.stats.generation_tokens_total += 1
            self.stats.token_events.append(
                TokenEvent(seq.display_id, seq.num_output_tokens - 1, now)
            )
            hit_stop = seq.detokenizer.add_tokens([token])
            # A complete grammar ends the output even where EOS alone would not (ignore_eos).
            reason = seq.check_stop(hit_stop) or ("stop" if grammar_done else None)
            if reason is not None:
                break
        if reason is not None:
            handoff = None
            if seq.lease_on_finish and reason == "length":
                handoff = self.transfer.lease(seq, now)
            self.scheduler.remove(seq)
            out = self._finish(seq, reason, None, new_token_ids=emitted)
            out.kv_handoff = handoff
        else:
            out = self._output(seq, emitted, seq.detokenizer.take_delta(final=False))
        if raws[0] is not None:
            out.new_logprobs = [
                self._token_logprobs(t, r)  # type: ignore[arg-type]
                for t, r in zip(emitted, raws, strict=False)
            ]
        return out

    def _token_logprobs(self, token: int, raw: RawLogprobs) -> TokenLogprobs:
        decode = self.tokenizer.decode
        top = [(t, decode([t]), lp) for t, lp in raw[1]]
        return TokenLogprobs(token, decode([token]), raw[0], top)

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """The prompt is computed: split into n sequences sharing its blocks."""
        children = []
        for index in range(1, parent.num_forks):
            child = Sequence(
                request_id=parent.request_id,
                index=index,
                token_ids=list(parent.token_ids),
                num_prompt_tokens=parent.num_prompt_tokens,
                params=parent.params,
                seed=_child_seed(parent.seed, index),
                detokenizer=IncrementalDetokenizer(
                    self.tokenizer, parent.token_ids, parent.params.stop
                ),
                metrics=RequestMetrics(
                    parent.metrics.arrival_time, parent.metrics.first_scheduled_time, None, None
                ),
                root_hash=parent.root_hash,
                max_total_tokens=parent.max_total_tokens,
                eos_token_ids=parent.eos_token_ids,
                num_cached_tokens=parent.num_cached_tokens,
                rope_long=parent.rope_long,
                num_tools=parent.num_tools,
            )
            if parent.grammar is not None:  # each sequence walks the grammar on its own
                child.grammar = parent.grammar.fork(parent.output_token_ids)  # type: ignore[attr-defined]
            self.kv.fork(parent, child)
            self.scheduler.add_forked(child)
            self.requests[parent.request_id].append(child)
            children.append(child)
        parent.num_forks = 1
        return children

    def _fail_batch(self, batch: ScheduledBatch, message: str) -> list[RequestOutput]:
        outputs = []
        for seq in batch.seqs:
            # Blocks hashed for this step never got their K/V: they must not be hit later.
            first_unwritten = seq.num_computed_tokens // self.block_size
            self.scheduler.remove(seq, keep_hashes_below=first_unwritten)
            outputs.append(self._finish(seq, "error", message))
        for request_id in {s.request_id for s in batch.seqs}:
            for seq in self.requests.get(request_id, []):
                if not seq.is_finished:
                    self.scheduler.remove(seq)
                    outputs.append(self._finish(seq, "error", message))
        return outputs

    def _finish(
        self, seq: Sequence, reason: str, error: str | None, new_token_ids: list[int] | None = None
    ) -> RequestOutput:
        seq.status = SequenceStatus.FINISHED
        seq.num_forks = 1  # a request that ends before its prompt is done never forks
        self.transfer.release_held(seq)
        if seq.grammar is not None:
            self._forget_drafts(seq)
        seq.finish_reason = reason
        seq.error = error
        seq.metrics.finished_time = self.clock()
        self.stats.num_requests_finished += 1
        self.histograms.observe_finished(seq)
        family = self.requests.get(seq.request_id, [])
        if family and all(s.is_finished for s in family):
            del self.requests[seq.request_id]
        out = self._output(seq, new_token_ids or [], seq.detokenizer.take_delta(final=True))
        out.finish_reason = reason
        out.error = error
        out.metrics = seq.metrics
        return out

    def _output(self, seq: Sequence, new_ids: list[int], delta: str) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            index=seq.index,
            new_token_ids=new_ids,
            text_delta=delta,
            token_ids=seq.output_token_ids,
            text=seq.detokenizer.text[: seq.detokenizer.emitted],
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            metrics=seq.metrics,  # token times of every output so far, for streaming clients
            num_draft_tokens=seq.num_draft_tokens,
            num_accepted_tokens=seq.num_accepted_tokens,
        )


def _history(seq: Sequence, num_drafts: int) -> list[int]:
    """The tokens before a row's position (the penalties count them): a speculative row's
    drafts before it are part of it, as they are if the row's token is used at all."""
    if num_drafts == 0 or not seq.params.has_penalties:
        return seq.token_ids
    return seq.token_ids + seq.spec_token_ids[:num_drafts]


def _child_seed(seed: int, index: int) -> int:
    """Seed of sequence `index` of an n > 1 request; sequence 0 keeps the request's seed."""
    return (seed + index * 0x9E3779B97F4A7C15) % 2**63
