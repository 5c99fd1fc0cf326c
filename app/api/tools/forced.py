"""`tool_choice: "required"` or a named function: the calls are forced with structured output.

As vLLM does, the model must write a JSON array of calls `[{"name": ..., "parameters": {...}}]`
whose schema allows exactly the permitted tools, each with its own parameters schema; one call
at most when `parallel_tool_calls` is false. The engine enforces the schema while sampling
(StructuredOutput, field "tool_choice"), so the array always parses and validates; reading it
back (`read_forced`) turns it into calls, or into content when it does not parse (an engine
that does not enforce grammars, or a reply cut by max_tokens).
"""

from __future__ import annotations

import json
from typing import Any

from app.api.tools.base import ParsedCall, calls_of_values, json_values
from ipc import protocol as P

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def forced_schema(tools: list[dict[str, Any]], choice: str | dict[str, Any],
                  parallel: bool) -> dict[str, Any]:  # fmt: skip
    """The JSON schema of the allowed calls (`choice` "required" or {"type": "function", ...})."""
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        allowed = [t for t in tools if t["function"]["name"] == name]
    else:
        allowed = tools
    variants = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t["function"]["name"]]},
                "parameters": t["function"].get("parameters") or EMPTY_PARAMETERS,
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in allowed
    ]
    items = variants[0] if len(variants) == 1 else {"anyOf": variants}
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": items}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def forced_structured(tools: list[dict[str, Any]], choice: str | dict[str, Any],
                      parallel: bool) -> P.StructuredOutput:  # fmt: skip
    schema = forced_schema(tools, choice, parallel)
    return P.StructuredOutput(kind="json", spec=json.dumps(schema), field="tool_choice")


def read_forced(text: str) -> list[ParsedCall] | None:
    values = json_values(text)
    if values is None or len(values) != 1 or not isinstance(values[0], list):
        return None
    return calls_of_values(values)
