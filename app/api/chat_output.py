"""What a chat choice's text means: content, reasoning and tool calls, whole and streamed.

The engine streams text. Chat Completions, the Responses API and the Messages API all need the
same reading of it: the part inside the template's thinking markers is reasoning, a tool call in
the template family's syntax is a call (never content, never half a call), the rest is content.
This module holds the types every encoder consumes; the parsers that produce them live in
app/api/tools/ and app/api/reasoning.py, and `ChoiceReader` (below) chains them per choice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from app.api.reasoning import ReasoningSplitter
from app.api.tools import ToolStream, family
from app.api.tools.base import ToolEvent, new_call_id
from app.api.tools.forced import read_forced


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


class ChoiceReader:
    """Reads one choice's text as it streams: thinking -> ReasoningDelta, tool calls (the plan's
    family under `tool_choice: auto`, the forced JSON array under `required` / a named tool) ->
    ToolCallStart + ToolCallArguments, the rest -> ContentDelta. `plan` is a GenerationPlan
    (app/api/requests.py); whole and streamed reading give the same events.

    Usage: `feed(text)` per engine delta, `finish()` once at the end (flushes held-back text),
    then `output()`. `feed(text, num_tokens=k)` also counts the delta's tokens as reasoning
    tokens when they touch the thinking block (exact when deltas are one token each).
    """

    def __init__(self, plan: Any) -> None:
        self._splitter = (
            ReasoningSplitter(start_inside=getattr(plan, "reasoning_open", False))
            if getattr(plan, "reasoning", False)
            else None
        )
        tools = getattr(plan, "tools", None)
        choice = getattr(plan, "tool_choice", "auto")
        self._forced = bool(tools) and choice != "auto" and choice != "none"
        self._stream = ToolStream(family(plan.tool_parser)) if tools and choice == "auto" else None
        self._forced_text: list[str] = []
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._calls: list[ToolCall] = []
        self._reasoning_tokens = 0
        self._finished = False

    def feed(self, text: str, num_tokens: int = 0) -> list[ChoiceEvent]:
        if self._splitter is None:
            return self._content_events(text, final=False)
        was_inside = self._splitter.inside
        out: list[ChoiceEvent] = []
        pieces = self._splitter.feed(text)
        for kind, piece in pieces:
            if kind == "reasoning":
                self._reasoning.append(piece)
                out.append(ReasoningDelta(piece))
            else:
                out.extend(self._content_events(piece, final=False))
        if was_inside or self._splitter.inside:
            self._reasoning_tokens += num_tokens
        return out

    def finish(self) -> list[ChoiceEvent]:
        if self._finished:
            return []
        self._finished = True
        out: list[ChoiceEvent] = []
        if self._splitter is not None:
            for kind, piece in self._splitter.finish():
                if kind == "reasoning":
                    self._reasoning.append(piece)
                    out.append(ReasoningDelta(piece))
                else:
                    out.extend(self._content_events(piece, final=False))
        out.extend(self._content_events("", final=True))
        return out

    def output(self) -> ChoiceOutput:
        seen = self._splitter is not None and self._splitter.seen
        return ChoiceOutput(
            content="".join(self._content),
            reasoning="".join(self._reasoning) if seen else None,
            tool_calls=list(self._calls),
            reasoning_tokens=self._reasoning_tokens,
        )

    # ------------------------------------------------------------------

    def _content_events(self, text: str, final: bool) -> list[ChoiceEvent]:
        if self._forced:
            self._forced_text.append(text)
            return self._forced_events() if final else []
        if self._stream is None:
            events: list[ChoiceEvent] = [ContentDelta(text)] if text else []
        else:
            raw = self._stream.feed(text) if text else []
            if final:
                raw.extend(self._stream.finish())
            events = [_event_of(e) for e in raw]
        return self._record(events)

    def _forced_events(self) -> list[ChoiceEvent]:
        text = "".join(self._forced_text)
        calls = read_forced(text)
        if calls is None:  # not enforced, or cut short: the model's text, as content
            return self._record([ContentDelta(text)] if text else [])
        events: list[ChoiceEvent] = []
        for i, call in enumerate(calls):
            call_id = new_call_id()
            events += [ToolCallStart(i, call_id, call.name), ToolCallArguments(i, call.arguments)]
        return self._record(events)

    def _record(self, events: list[ChoiceEvent]) -> list[ChoiceEvent]:
        for e in events:
            if isinstance(e, ContentDelta):
                self._content.append(e.text)
            elif isinstance(e, ToolCallStart):
                self._calls.append(ToolCall(e.id, e.name, ""))
            elif isinstance(e, ToolCallArguments):
                self._calls[e.index].arguments += e.text
        return events


def _event_of(e: ToolEvent) -> ChoiceEvent:
    if e[0] == "content":
        return ContentDelta(e[1])
    if e[0] == "start":
        return ToolCallStart(e[1], e[2], e[3])
    return ToolCallArguments(e[1], e[2])
