"""Another API's request, written as a Chat Completions body, then validated by parse_chat.

The Responses and Messages APIs translate their bodies into a chat body (messages, OpenAI
function tools, tool_choice, response_format, sampling fields) and hand it to the one chat
validator, so every value is checked by the same rules as /v1/chat/completions. A refusal from
there names the chat field; `ChatBody.plan` rewrites it to the caller's own field ("max_tokens"
-> "max_output_tokens", "messages[3]" -> "input[2]") so the 400 names what the client sent.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from app.api.errors import APIError, bad_request
from app.api.requests import GenerationPlan, Limits, parse_chat

_INDEXED = re.compile(r"\b(messages|tools)\[(\d+)\]")


@dataclass(slots=True)
class ChatBody:
    """A chat body under construction, with where each of its messages and tools came from."""

    body: dict[str, Any] = field(default_factory=dict)
    message_sources: list[str] = field(default_factory=list)  # chat message i <- this path
    tool_sources: list[str] = field(default_factory=list)  # chat tool i <- this path
    renames: dict[str, str] = field(default_factory=dict)  # chat field -> the API's field
    # chat's nested paths -> the API's, in order (".function.parameters" -> ".input_schema")
    suffixes: dict[str, str] = field(default_factory=dict)

    def add_message(self, message: dict[str, Any], source: str) -> dict[str, Any]:
        self.body.setdefault("messages", []).append(message)
        self.message_sources.append(source)
        return message

    @property
    def messages(self) -> list[dict[str, Any]]:
        return self.body.setdefault("messages", [])  # type: ignore[no-any-return]

    def plan(self, limits: Limits) -> GenerationPlan:
        try:
            return parse_chat(self.body, limits)
        except APIError as exc:
            raise self.rename(exc) from None

    def rename(self, exc: APIError) -> APIError:
        def sub(text: str) -> str:
            def one(m: re.Match[str]) -> str:
                sources = self.message_sources if m[1] == "messages" else self.tool_sources
                i = int(m[2])
                return sources[i] if i < len(sources) else m[0]

            text = _INDEXED.sub(one, text)
            for old, new in self.suffixes.items():
                text = text.replace(old, new)
            for old, new in self.renames.items():
                text = re.sub(rf"(?<![\w.]){re.escape(old)}\b", new, text)
            return text

        param = None if exc.param is None else sub(exc.param)
        return APIError(exc.status, sub(exc.message), param=param, code=exc.code,
                        headers=exc.headers)  # fmt: skip


# ------------------------------------------------------------------ small checks


def refuse_fields(body: dict[str, Any], refused: dict[str, str]) -> None:
    """A set field that would change the output and cannot be honoured: 400 naming it."""
    for name, why in refused.items():
        if body.get(name) not in (None, False, [], {}, ""):
            raise bad_request(f"{name}: {why}", name, "unsupported_parameter")


def check_known(body: dict[str, Any], known: frozenset[str] | set[str], where: str = "") -> None:
    for name in body:
        if name not in known:
            path = f"{where}.{name}" if where else name
            raise bad_request(f"unknown field `{path}`", path, "unknown_parameter")


def expect_object(value: Any, where: str, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise bad_request(f"{where} must be {what}", where)
    return value


def expect_str(value: Any, where: str, allow_empty: bool = True) -> str:
    if not isinstance(value, str) or (not allow_empty and not value):
        raise bad_request(f"{where} must be a {'' if allow_empty else 'non-empty '}string", where)
    return value


def expect_choice(value: Any, where: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise bad_request(
            f"{where} must be one of {', '.join(repr(a) for a in allowed)}, got {value!r}", where
        )
    return value  # type: ignore[no-any-return]
