"""Draft-model proposals: a smaller model with the target's tokenizer runs k tokens ahead of
each decoding sequence, greedily, and those tokens are the drafts the target verifies.

The draft model is a second engine in this process, with its own paged KV pool and prefix
cache. Before each target step, every sequence about to decode becomes one request of the draft
engine: all its known tokens as the prompt, k tokens to generate. The draft engine's prefix
cache still holds that history from the step before, so only the last partial block and the
tokens accepted since are computed again, then k - 1 batched decode steps. Greedy drafts are
point masses, for which verify.py's acceptance rule reproduces the target's own tokens whatever
the drafts are: a poor draft model costs speed, never correctness.

Under structured output, the draft request of a constrained sequence follows the target's grammar
where the target is in it (DraftConstraints: engine_proc/structured/draft.py), its rows masked
as the target's are: drafts the grammar refuses would only be rejected."""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from engine_proc.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine_proc.core.request import Sequence
    from engine_proc.outputs import RequestOutput

logger = logging.getLogger(__name__)

SeqKey = tuple[str, int]


def seq_key(seq: Sequence) -> SeqKey:
    return seq.request_id, seq.index


def check_same_tokenizer(target: Any, draft: Any, draft_path: str) -> None:
    """Drafts are token ids: both models must give every id the same piece of text."""
    if target.get_vocab() != draft.get_vocab():
        raise ValueError(
            f"speculative_config: the draft model {draft_path!r} has a different tokenizer "
            f"({len(draft.get_vocab())} tokens) from the target model's "
            f"({len(target.get_vocab())} tokens); a draft model must share the target's "
            "tokenizer (e.g. a smaller model of the same family)"
        )


class DraftEngine(Protocol):
    """What the proposer uses of the draft model's LLMEngine (the engine layer sits above
    this package)."""

    model_config: Any
    max_total_tokens: int

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams) -> None: ...
    def step(self) -> list[RequestOutput]: ...
    def is_active(self, request_id: str) -> bool: ...
    def abort_request(self, request_id: str) -> list[RequestOutput]: ...

    requests: dict[str, list[Sequence]]


class DraftConstraints(Protocol):
    """The target's grammars for the draft requests (engine_proc/structured/draft.py)."""

    def start(self, seq: Sequence) -> object | None: ...  # a draft request's grammar state
    def forget(self, key: SeqKey) -> None: ...
    def retain(self, keys: set[SeqKey]) -> None: ...


@dataclass(slots=True)
class DraftModelProposer:
    engine: DraftEngine  # the draft model's own engine (no speculation of its own)
    num_speculative_tokens: int
    constraints: DraftConstraints | None = None  # None: drafts ignore grammars
    drafts: dict[SeqKey, list[int]] = field(default_factory=dict)  # this step's, by sequence
    _ids: Any = field(default_factory=itertools.count)

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    def prepare(self, wanted: list[tuple[Sequence, int]], running: list[Sequence]) -> None:
        """Run the draft model for each (sequence, at most k drafts), batched; the drafts wait
        in self.drafts for the scheduler's propose(seq, k) of this step. `running`: the target's
        running sequences, the only ones whose grammar state is kept."""
        self.drafts.clear()
        if self.constraints is not None:
            self.constraints.retain({seq_key(s) for s in running})
        engine = self.engine
        pending: dict[str, SeqKey] = {}
        for seq, k in wanted:
            k = min(k, self.num_speculative_tokens)
            if k <= 0 or seq.num_tokens + k > engine.max_total_tokens:
                continue  # past the draft model's own context: the target decodes alone
            request_id = f"draft-{next(self._ids)}"
            # the target's logit_bias shapes its tokens, so the draft's too (penalties count
            # outputs, which the draft request's differ from: left to the target)
            bias = {t: b for t, b in seq.params.logit_bias.items() if t < self.vocab_size}
            params = SamplingParams(max_tokens=k, temperature=0, speculative=False,
                                    logit_bias=bias)  # fmt: skip
            grammar = None
            if seq.grammar is not None and self.constraints is not None:
                grammar = self.constraints.start(seq)
            try:
                engine.add_request(request_id, list(seq.token_ids), params)
            except ValueError as exc:  # e.g. a token id past the draft model's embeddings
                logger.debug("no drafts for %s: %s", seq.request_id, exc)
                continue
            if grammar is not None:  # masked and walked by the draft engine as its own
                engine.requests[request_id][0].grammar = grammar
            pending[request_id] = seq_key(seq)
        try:
            while pending:
                for out in engine.step():
                    if out.finished and out.request_id in pending:
                        self.drafts[pending.pop(out.request_id)] = list(out.token_ids)
                for request_id in [r for r in pending if not engine.is_active(r)]:
                    pending.pop(request_id)  # failed in the draft engine: no drafts, no harm
        except Exception:  # the target decodes this step without drafts, and goes on
            logger.exception("the draft model's step failed; no drafts this step")
            self.drafts.clear()
            for request_id in pending:
                if engine.is_active(request_id):
                    engine.abort_request(request_id)

    def forget(self, seq: Sequence) -> None:
        """The target sequence is done (finished or aborted): drop its grammar state."""
        if self.constraints is not None:
            self.constraints.forget(seq_key(seq))

    def propose(self, seq: Sequence, k: int) -> list[int]:
        return self.drafts.get(seq_key(seq), [])[:k]
