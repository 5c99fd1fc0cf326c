"""Incremental detokenization: emit only text that is final, never half a multi-byte character,
and hold back just enough characters that a stop string can still be cut off cleanly."""

from __future__ import annotations

from typing import Any

# A few prompt tokens give the tokenizer the context it needs to decode the first output token
# (leading spaces of SentencePiece-style vocabularies).
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: list[int], stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # all final text so far (stop string removed)
        self.emitted = 0  # characters of self.text already handed out

    def add_tokens(self, token_ids: list[int]) -> bool:
        """Append tokens; True when a stop string appeared (the text then ends before it)."""
        self.ids.extend(token_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return False  # an incomplete UTF-8 sequence: wait for the next token
        start = len(self.text)
        self.text += new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._cut_at_stop(start)

    def take_delta(self, final: bool) -> str:
        end = len(self.text) if final else max(self.emitted, len(self.text) - self.holdback)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta

    def _cut_at_stop(self, new_from: int) -> bool:
        if not self.stop:
            return False
        search_from = max(0, new_from - self.holdback)
        hits = [i for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
        if not hits:
            return False
        self.text = self.text[: min(hits)]
        return True

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
