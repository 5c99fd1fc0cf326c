"""The engine's structured-output state: requests whose grammar is compiling wait here, outside
the scheduler (the others keep being served), and enter it once their grammar is ready; a
grammar that cannot compile refuses its request (invalid_request, naming the API field)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine_proc.core.request import Sequence

if TYPE_CHECKING:
    from engine_proc.structured.compiler import GrammarCompiler

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Parked:
    seq: Sequence
    key: str  # the grammar's digest


@dataclass(slots=True)
class Admission:
    """What one poll decided: sequences whose grammar is ready, requests refused (id, why)."""

    ready: list[Sequence] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)


class StructuredOutputs:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = eos_token_ids
        self._compiler: GrammarCompiler | None = None  # built on the first constrained request
        self.parked: dict[str, Parked] = {}

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:  # engines that never see a grammar start no thread
            # and never import xgrammar (~0.4 s of every engine start otherwise)
            from engine_proc.structured.compiler import GrammarCompiler
            from engine_proc.structured.grammar import tokenizer_info

            self._compiler = GrammarCompiler(
                lambda: tokenizer_info(self._tokenizer, self._vocab_size, self._eos)
            )
        return self._compiler

    def admit(self, seq: Sequence) -> bool:
        """True when the grammar is ready and attached (schedule the sequence now); False when
        it is compiling (the sequence is parked). ValueError when it is known not to compile."""
        so = seq.params.structured
        assert so is not None
        compiler = self.compiler
        key = compiler.submit(so.kind, so.spec, so.field)
        done = compiler.result(key, so.field)
        if done is None:
            self.parked[seq.request_id] = Parked(seq, key)
            return False
        if done.error is not None:
            raise ValueError(done.error)
        seq.grammar = _start(so.kind, done.grammar, seq.output_token_ids)
        return True

    def poll(self) -> Admission:
        out = Admission()
        for rid, parked in list(self.parked.items()):
            so = parked.seq.params.structured
            assert so is not None
            done = self.compiler.result(parked.key, so.field)
            if done is None:
                continue
            del self.parked[rid]
            if done.error is not None:
                out.refused.append((rid, done.error))
                continue
            seq = parked.seq
            seq.grammar = _start(so.kind, done.grammar, seq.output_token_ids)
            out.ready.append(seq)
        return out

    def wait(self, timeout: float) -> None:
        """An idle step loop: sleep until a parked grammar is compiled (or `timeout`)."""
        if self.parked:
            self.compiler.wait_any([p.key for p in self.parked.values()], timeout)

    def discard(self, request_id: str) -> None:
        """An aborted request: forget it (its compile finishes into the cache)."""
        self.parked.pop(request_id, None)

    def close(self) -> None:
        if self._compiler is not None:
            self._compiler.close()


def _start(kind: str, grammar: Any, output_token_ids: list[int]) -> Any:
    from engine_proc.structured.matcher import SeqGrammar

    return SeqGrammar.start(kind, grammar, output_token_ids)
