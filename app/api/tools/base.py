"""The streaming machinery shared by every tool-call family.

A family (hermes.py, llama3.py, mistral.py, pythonic.py) says where a call region starts and
ends and how to read one; `ToolStream` turns a choice's content text into events with it:

- text that may be the beginning of a start marker is held back, so `auto` never hands half a
  marker (or half a call) to the client as content;
- a region is read only once it is whole (its end marker, or the end of the output), and only a
  region that reads as calls becomes calls: a malformed or truncated one comes back as content,
  exactly the text the model wrote (nothing is lost, nothing raises).

Because a region is read whole, a streamed call arrives as its start (id, name) then its
arguments; the events equal those of reading the whole text at once, wherever it is split.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# What ToolStream emits (app/api/chat_output.py's ChoiceReader turns these into its events;
# plain tuples, so that the parsers do not import the module that uses them):
# ("content", text) | ("start", index, call id, name) | ("arguments", index, text)
ToolEvent = tuple[Any, ...]


@dataclass(slots=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object's text


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call_of(obj: Any) -> ParsedCall | None:
    """{"name", "arguments" | "parameters"} (arguments an object or its JSON text) -> a call;
    None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def json_values(text: str) -> list[Any] | None:
    """Every JSON value in `text`, one after another (whitespace, `;` or `,` between them);
    None unless the whole text is such values."""
    decoder = json.JSONDecoder()
    values: list[Any] = []
    i, n = 0, len(text)
    while True:
        while i < n and (text[i].isspace() or (values and text[i] in ";,")):
            i += 1
        if i >= n:
            return values or None
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        values.append(value)


def calls_of_values(values: list[Any] | None) -> list[ParsedCall] | None:
    """JSON values that are calls or lists of calls -> the calls (None if any is not one)."""
    if not values:
        return None
    calls: list[ParsedCall] = []
    for value in values:
        for obj in value if isinstance(value, list) else [value]:
            call = call_of(obj)
            if call is None:
                return None
            calls.append(call)
    return calls or None


@dataclass(frozen=True, slots=True)
class Family:
    """How one template family writes calls.

    start_markers: a region starts at any of these, anywhere in the content;
    leading: a region also starts when the output's first non-blank character is one of these;
    end_marker: a region ends there (None: it runs to the end of the output);
    read: a whole region's text (markers included) -> its calls, or None when it is not calls.
    """

    name: str
    start_markers: tuple[str, ...]
    leading: str
    end_marker: str | None
    read: Callable[[str], list[ParsedCall] | None]


class ToolStream:
    """One choice's content -> content, call start and call arguments events (ToolEvent)."""

    def __init__(self, family: Family, first_index: int = 0) -> None:
        self.family = family
        self.next_index = first_index
        self.calls: list[tuple[str, ParsedCall]] = []  # (id, call), in order
        self._buf = ""  # content not yet emitted (outside a region)
        self._region: str | None = None  # the region being read, markers included
        self._at_start = True  # nothing but blanks seen yet (for `leading`)

    def feed(self, text: str) -> list[ToolEvent]:
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> list[ToolEvent]:
        return self._drain(final=True)

    # ------------------------------------------------------------------

    def _drain(self, final: bool) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        fam = self.family
        while True:
            if self._region is not None:
                self._region += self._buf
                self._buf = ""
                end = fam.end_marker
                cut = self._region.find(end, 1) if end else -1
                if cut >= 0:
                    cut += len(end)  # type: ignore[arg-type]
                    region, self._buf = self._region[:cut], self._region[cut:]
                    self._region = None
                    out.extend(self._close(region))
                    continue
                if final:
                    region, self._region = self._region, None
                    out.extend(self._close(region))
                return out
            if self._at_start and fam.leading:
                stripped = self._buf.lstrip()
                if not stripped:
                    if final and self._buf:
                        out.append(("content", self._buf))
                        self._buf = ""
                    return out  # only blanks so far: the region may still start
                self._at_start = False
                if stripped[0] in fam.leading:
                    self._region, self._buf = self._buf, ""
                    continue
            at, marker = self._find_marker(self._buf)
            if at >= 0:
                if at:
                    out.append(("content", self._buf[:at]))
                self._at_start = False
                self._region, self._buf = self._buf[at:], ""
                continue
            keep = 0 if final else _partial_suffix(self._buf, fam.start_markers)
            text = self._buf[: len(self._buf) - keep]
            self._buf = self._buf[len(self._buf) - keep :]
            if text:
                out.append(("content", text))
                if text.strip():
                    self._at_start = False
            return out

    def _find_marker(self, text: str) -> tuple[int, str]:
        best, which = -1, ""
        for m in self.family.start_markers:
            i = text.find(m)
            if i >= 0 and (best < 0 or i < best):
                best, which = i, m
        return best, which

    def _close(self, region: str) -> list[ToolEvent]:
        calls = self.family.read(region)
        if not calls:
            return [("content", region)]  # not calls after all: the model's text, as it was
        out: list[ToolEvent] = []
        for call in calls:
            call_id = new_call_id()
            self.calls.append((call_id, call))
            out.append(("start", self.next_index, call_id, call.name))
            out.append(("arguments", self.next_index, call.arguments))
            self.next_index += 1
        return out


def _partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper beginning of a marker."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best
