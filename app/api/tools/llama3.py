"""Llama 3.1 / 3.2 / 3.3 JSON tool calls: the reply is `{"name": ..., "parameters": {...}}`
(several separated by `;`), optionally after `<|python_tag|>` (kept in the text only when the
server does not skip special tokens). A reply that starts with `{` but is not calls is content."""

from __future__ import annotations

from app.api.tools.base import Family, ParsedCall, calls_of_values, json_values

PYTHON_TAG = "<|python_tag|>"


def read(region: str) -> list[ParsedCall] | None:
    body = region.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG) :]
    return calls_of_values(json_values(body))


FAMILY = Family("llama3_json", (PYTHON_TAG,), "{", None, read)
