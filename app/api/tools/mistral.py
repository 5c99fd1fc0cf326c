"""Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (v3 tokenizers) or
`[TOOL_CALLS]name[ARGS]{...}` repeated (v11 and later); content before the marker."""

from __future__ import annotations

from app.api.tools.base import Family, ParsedCall, call_of, calls_of_values, json_values

MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"


def read(region: str) -> list[ParsedCall] | None:
    parts = [p for p in region.split(MARKER) if p.strip()]
    if not parts:
        return None
    calls: list[ParsedCall] = []
    for part in parts:
        if ARGS in part:
            name, _, args = part.partition(ARGS)
            values = json_values(args)
            if values is None or len(values) != 1:
                return None
            call = call_of({"name": name.strip(), "arguments": values[0]})
            if call is None:
                return None
            calls.append(call)
            continue
        found = calls_of_values(json_values(part))
        if found is None:
            return None
        calls.extend(found)
    return calls


FAMILY = Family("mistral", (MARKER,), "", None, read)
