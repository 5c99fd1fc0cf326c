"""A reply's thinking: the text between the template's markers (`<think>` … `</think>`), split
from the answer for the window's collapsible block.

The window re-reads a reply's whole text at each refresh, so a whole-text split is enough here
(the HTTP API streams to clients and holds back partial markers instead: app/api/reasoning.py).
Models whose prompt already opens the block (ModelInfo.reasoning_parser "think_open") start
inside it. Only the first block is thinking, as in the API.
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"


@dataclass(slots=True)
class Split:
    reasoning: str | None  # None: the reply has no thinking block
    answer: str
    thinking: bool  # the block is still open (the reply is thinking now)


def split_thinking(text: str, starts_inside: bool = False) -> Split:
    if not starts_inside:
        head = text.lstrip()
        if not head.startswith(START):
            # a partial marker at the very start, while it streams: not yet the answer
            if head and START.startswith(head):
                return Split(reasoning="", answer="", thinking=True)
            return Split(reasoning=None, answer=text, thinking=False)
        text = head[len(START):]
    end = text.find(END)
    if end < 0:
        return Split(reasoning=_strip_partial_end(text), answer="", thinking=True)
    return Split(reasoning=text[:end].strip("\n"), answer=text[end + len(END):].lstrip("\n"),
                 thinking=False)  # fmt: skip


def _strip_partial_end(text: str) -> str:
    """Hide a trailing piece of `</think>` that has not fully arrived."""
    for k in range(min(len(END) - 1, len(text)), 0, -1):
        if text.endswith(END[:k]):
            return text[:-k]
    return text
