"""What a chat choice's text means: content, reasoning and tool calls, whole and streamed.

The engine streams text. Chat Completions, the Responses API and the Messages API all need the
same reading of it: the part inside the template's thinking markers is reasoning, a tool call in
the template family's syntax is a call (never content, never half a call), the rest is content.
This module holds the types every encoder consumes; the parsers that produce them live in
app/api/tools/ and app/api/reasoning.py, and `ChoiceReader` (below) chains them per choice.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class ToolCall:
    id: str  # "call_<hex>"
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it


@dataclass(slots=True)
class ChoiceOutput:
    """A finished choice, read."""

    content: str
    reasoning: str | None = None  # None: the model did not think (or thinking was off)
    tool_calls: list[ToolCall] = field(default_factory=list)
    reasoning_tokens: int = 0


# Streamed events, in the order they happen within one choice.


@dataclass(slots=True)
class ContentDelta:
    text: str


@dataclass(slots=True)
class ReasoningDelta:
    text: str


@dataclass(slots=True)
class ToolCallStart:
    index: int  # 0, 1, ... within the choice
    id: str
    name: str


@dataclass(slots=True)
class ToolCallArguments:
    index: int
    text: str  # the next piece of the arguments' JSON text


ChoiceEvent = ContentDelta | ReasoningDelta | ToolCallStart | ToolCallArguments
