"""One sequence's position in its grammar. Each sequence of an n > 1 request owns one (they
sample different tokens). Preemption needs nothing here: a preempted sequence keeps its output
tokens and recomputes their K/V, so the matcher, which has consumed exactly those tokens, is
still where the sequence is."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import xgrammar as xgr

HISTORY = 256  # steps of allowed-token counts kept for telemetry


@dataclass(slots=True)
class SeqGrammar:
    kind: str  # the StructuredOutput kind, shown in telemetry
    compiled: Any  # xgrammar.CompiledGrammar: forked sequences start their own matcher on it
    matcher: Any  # xgrammar.GrammarMatcher
    # tokens the grammar allowed at each of the last HISTORY steps (what the constraint did)
    allowed: deque[int] = field(default_factory=lambda: deque(maxlen=HISTORY))
    rejected: bool = False  # a token the grammar refused was consumed (should never happen)

    @classmethod
    def start(cls, kind: str, grammar: Any, consumed: list[int]) -> SeqGrammar:
        """A matcher at the grammar's start that has consumed `consumed` (outputs a sequence
        already has, e.g. a disaggregated request's first token)."""
        state = cls(kind, grammar, xgr.GrammarMatcher(grammar))
        for token in consumed:
            state.accept(token)
        return state

    def fork(self, consumed: list[int]) -> SeqGrammar:
        return SeqGrammar.start(self.kind, self.compiled, consumed)

    def accept(self, token: int) -> None:
        if not self.matcher.accept_token(token):
            self.rejected = True

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token consumed: the output is done."""
        return self.matcher.is_terminated()
