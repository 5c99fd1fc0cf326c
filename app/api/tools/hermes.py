"""Hermes / Qwen 2.5 / Qwen 3: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`,
one block per call, content before, between and after them. Also the convention of KVScope's
system-prompt fallback for templates without tool support (engine_proc/engine/tools.py)."""

from __future__ import annotations

from app.api.tools.base import Family, ParsedCall, calls_of_values, json_values

START, END = "<tool_call>", "</tool_call>"


def read(region: str) -> list[ParsedCall] | None:
    body = region[len(START) :]
    if body.endswith(END):
        body = body[: -len(END)]
    # a call whose closing tag was cut by a stop (or EOS) but whose JSON is whole still counts
    return calls_of_values(json_values(body))


FAMILY = Family("hermes", (START,), "", END, read)
