"""The target's grammars for a draft model's requests (engine_proc/spec_decode/draft_model.py).

Each constrained target sequence that drafts keeps one matcher of its grammar here, advanced
only by the tokens the target confirms (its outputs), a few a step: never the whole output again.
Each draft request gets its own fork of that matcher (xgrammar copies the parse state, not the
history), which walks the draft model's greedy tokens under the same per-row masks as the
target's; the tracked matcher never sees a draft, so nothing has to be rolled back, whatever
becomes of the draft request.

A matcher that refuses a confirmed token (the target's own matcher would have too: it should
never happen) or raises leaves its sequence's drafts unconstrained, as they were before drafts
followed grammars: a poorer draft, never a wrong token (the target's rows are masked anyway).
xgrammar is imported with the first constrained draft, as by the engine's own grammars."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine_proc.core.request import Sequence

if TYPE_CHECKING:
    from engine_proc.structured.matcher import SeqGrammar

logger = logging.getLogger(__name__)

SeqKey = tuple[str, int]


@dataclass(slots=True)
class Tracked:
    compiled: Any  # the target sequence's CompiledGrammar (a reused request id starts over)
    matcher: Any | None  # xgrammar.GrammarMatcher at `consumed` outputs; None: given up on
    consumed: int = 0  # target output tokens the matcher has accepted


class DraftGrammars:
    def __init__(self, draft_vocab_size: int) -> None:
        # The draft model's logits width: its masks are filled by the target's grammar, built
        # on the target's vocabulary (the same tokenizer; the embeddings may be padded apart).
        self.draft_vocab_size = draft_vocab_size
        self.tracked: dict[SeqKey, Tracked] = {}

    def start(self, seq: Sequence) -> SeqGrammar | None:
        """The grammar state a draft request of `seq` follows: a fresh matcher where the target
        sequence is in its grammar (after its outputs so far), or None (draft unconstrained)."""
        target = seq.grammar
        if target is None:
            return None
        from engine_proc.structured.matcher import SeqGrammar

        assert isinstance(target, SeqGrammar)
        key = (seq.request_id, seq.index)
        state = self.tracked.get(key)
        outputs = seq.output_token_ids
        try:
            if (state is None or state.compiled is not target.compiled
                    or state.consumed > len(outputs)):  # fmt: skip
                state = self.tracked[key] = Tracked(target.compiled, None)
                state.matcher = self._matcher(target)
            if state.matcher is None or target.rejected:
                return None
            for token in outputs[state.consumed :]:
                if not state.matcher.accept_token(token):
                    raise ValueError(f"the grammar refuses confirmed token {token}")
                state.consumed += 1
            if state.matcher.is_terminated():
                return None
            return SeqGrammar(target.kind, target.compiled, state.matcher.fork())
        except Exception as exc:  # this sequence drafts unconstrained; the others go on
            logger.warning("draft grammar of %s given up: %s", seq.request_id, exc)
            state.matcher = None
            return None

    def _matcher(self, target: SeqGrammar) -> Any | None:
        import xgrammar as xgr

        if target.compiled.tokenizer_info.vocab_size != self.draft_vocab_size:
            return None  # masks of another width than the draft model's logits
        return xgr.GrammarMatcher(target.compiled)

    def forget(self, key: SeqKey) -> None:
        """The target sequence finished, was aborted, or left the running set."""
        self.tracked.pop(key, None)

    def retain(self, keys: set[SeqKey]) -> None:
        """Drop every tracked sequence but `keys` (the running ones): a preempted sequence
        starts over when it runs again (its matcher is rebuilt from its outputs, once)."""
        for key in [k for k in self.tracked if k not in keys]:
            del self.tracked[key]
