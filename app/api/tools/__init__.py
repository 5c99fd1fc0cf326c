"""Tool calling on the API side: request validation (request.py), the families' parsers (one
file each) and the schema that forces `required` and named choices (forced.py).

A family is chosen per server: `kvscope serve --tool-call-parser NAME`, else what the engine
detected from the checkpoint's chat template (ModelInfo.tool_parser), else `hermes`, the
convention of the engine's system-prompt fallback for templates without tool support.
"""

from __future__ import annotations

from app.api.tools import hermes, llama3, mistral, pythonic
from app.api.tools.base import Family, ToolStream

FAMILIES: dict[str, Family] = {
    f.name: f for f in (hermes.FAMILY, llama3.FAMILY, mistral.FAMILY, pythonic.FAMILY)
}
# vLLM's names for the same formats
ALIASES = {"qwen": "hermes", "qwen2_5": "hermes", "qwen3": "hermes", "llama3": "llama3_json",
           "llama4_json": "llama3_json", "llama4_pythonic": "pythonic"}  # fmt: skip
DEFAULT_FAMILY = "hermes"


def family(name: str) -> Family:
    """The family of a parser name (vLLM's aliases too); ValueError naming the choices."""
    key = ALIASES.get(name, name)
    if key not in FAMILIES:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {sorted(FAMILIES)}")
    return FAMILIES[key]


__all__ = ["ALIASES", "DEFAULT_FAMILY", "FAMILIES", "Family", "ToolStream", "family"]
