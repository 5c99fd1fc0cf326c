"""Anthropic's Messages API (`POST /v1/messages`) over the chat core, and its error shape.

A request becomes a chat body (chat_body.py): `system` the system message, each message's
blocks the turns (`text` content, `tool_use` an assistant turn's tool calls, `tool_result` a
tool turn, `thinking` the assistant turn's reasoning), `tools` ({name, description,
input_schema}) OpenAI function tools, `tool_choice` auto/any/tool/none -> auto/required/a
named function/none (`disable_parallel_tool_use` -> parallel_tool_calls false),
`stop_sequences` stop, `thinking` the template's `enable_thinking`, `output_config.format` the
response_format and `output_config.effort` reasoning_effort.

Two approximations, both documented in docs/SERVING.md: `thinking.budget_tokens` is checked
(>= 1 and < max_tokens) but not enforced apart from max_tokens (the engine has no budget for
a part of the reply), and a `tool_result` with `is_error: true` reaches the template as a tool
turn whose text starts with "Error: " (chat templates have no error flag).

Errors are Anthropic's: {"type": "error", "error": {"type": "invalid_request_error", "message"}}.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse

from app.api.chat_body import ChatBody, check_known, expect_choice, expect_object, expect_str
from app.api.errors import APIError, bad_request
from app.api.requests import GenerationPlan, Limits

ACCEPTED = frozenset({
    "model", "max_tokens", "system", "messages", "tools", "tool_choice", "stop_sequences",
    "temperature", "top_p", "top_k", "stream", "thinking", "output_config",
    # harmless: they describe the caller or the account, not the output
    "metadata", "service_tier", "inference_geo", "speed", "cache_control",
})  # fmt: skip
REFUSED = {
    "container": "code execution containers are not supported",
    "mcp_servers": "MCP servers are not supported",
    "context_management": "context management is not supported",
    "diagnostics": "diagnostics are not supported",
}
RENAMES = {"stop": "stop_sequences", "response_format": "output_config.format",
           "reasoning_effort": "output_config.effort",
           "parallel_tool_calls": "tool_choice.disable_parallel_tool_use"}  # fmt: skip
SUFFIXES = {".function.parameters": ".input_schema", ".function.": ".",
            ".tool_call_id": ".tool_use_id"}  # fmt: skip
ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 413: "request_too_large", 415: "invalid_request_error",
    429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
}  # fmt: skip


@dataclass(slots=True)
class MessagesCall:
    plan: GenerationPlan


def parse_messages(body: Any, limits: Limits) -> MessagesCall:
    body = expect_object(body, "body", "a JSON object")
    for name, why in REFUSED.items():
        if body.get(name) not in (None, [], {}):
            raise bad_request(f"{name}: {why}", name, "unsupported_parameter")
    check_known(body, ACCEPTED)
    if body.get("max_tokens") is None:
        raise bad_request("max_tokens is required (an integer >= 1)", "max_tokens")
    chat = ChatBody(renames=RENAMES, suffixes=SUFFIXES)
    for name in ("model", "max_tokens", "top_p", "top_k", "stream"):
        if body.get(name) is not None:
            chat.body[name] = body[name]
    temperature = body.get("temperature")
    if temperature is not None:
        if isinstance(temperature, bool) or not isinstance(temperature, int | float) \
                or not 0 <= temperature <= 1:  # fmt: skip
            raise bad_request(f"temperature must be a number in [0, 1], got {temperature!r}",
                              "temperature")  # fmt: skip
        chat.body["temperature"] = temperature
    if body.get("stop_sequences") is not None:
        chat.body["stop"] = body["stop_sequences"]
    system = body.get("system")
    if system is not None:
        chat.add_message({"role": "system", "content": _system(system)}, "system")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of {role, content}", "messages")
    for i, message in enumerate(messages):
        _message(message, f"messages[{i}]", chat)
    _tools(body.get("tools"), chat)
    if body.get("tool_choice") is not None:
        _tool_choice(body["tool_choice"], chat)
    if body.get("thinking") is not None:
        _thinking(body["thinking"], body["max_tokens"], chat)
    if body.get("output_config") is not None:
        _output_config(body["output_config"], chat)
    return MessagesCall(plan=chat.plan(limits))


def parse_count_tokens(body: Any, limits: Limits) -> MessagesCall:
    """`POST /v1/messages/count_tokens`: a Messages body without max_tokens (nothing is
    generated); the plan's messages, tools and template arguments are what gets counted."""
    body = expect_object(body, "body", "a JSON object")
    for name in ("max_tokens", "stream"):
        if name in body:
            raise bad_request(f"unknown field `{name}` (count_tokens generates nothing)", name,
                              "unknown_parameter")  # fmt: skip
    return parse_messages({**body, "max_tokens": limits.max_tokens}, limits)


# ------------------------------------------------------------------ request pieces


def _system(system: Any) -> str:
    if isinstance(system, str):
        return system
    if isinstance(system, list):
        return "\n".join(_text_block(b, f"system[{j}]") for j, b in enumerate(system))
    raise bad_request("system must be a string or a list of text blocks", "system")


def _text_block(block: Any, where: str) -> str:
    block = expect_object(block, where, "a text block {type: 'text', text}")
    if block.get("type") != "text":
        raise bad_request(f"{where}.type must be 'text', got {block.get('type')!r}", where)
    check_known(block, {"type", "text", "cache_control", "citations"}, where)
    return expect_str(block.get("text"), f"{where}.text")


def _message(message: Any, where: str, chat: ChatBody) -> None:
    message = expect_object(message, where, "an object {role, content}")
    check_known(message, {"role", "content"}, where)
    role = expect_choice(message.get("role"), f"{where}.role", ("user", "assistant"))
    content = message.get("content")
    if isinstance(content, str):
        chat.add_message({"role": role, "content": content}, where)
        return
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of content blocks",
                          f"{where}.content")  # fmt: skip
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    thinking: list[str] = []
    allowed = ("text", "tool_result") if role == "user" else ("text", "tool_use", "thinking",
                                                               "redacted_thinking")  # fmt: skip
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        block = expect_object(block, at, "a content block with a type")
        kind = block.get("type")
        if kind in ("image", "document", "search_result"):
            raise bad_request(f"{at}: {kind} blocks are not supported (text-only model)", at,
                              "unsupported_content")  # fmt: skip
        if kind not in allowed:
            raise bad_request(f"{at}.type must be one of {list(allowed)} in a {role} message, "
                              f"got {kind!r}", f"{at}.type")  # fmt: skip
        if kind == "text":
            texts.append(_text_block(block, at))
        elif kind == "tool_result":
            # results come first in a user turn (Anthropic's rule); text after them is the
            # user's next words, so it follows the tool turns
            if texts:
                chat.add_message({"role": "user", "content": "\n".join(texts)}, where)
                texts = []
            chat.add_message(_tool_result(block, at), at)
        elif kind == "tool_use":
            check_known(block, {"type", "id", "name", "input", "cache_control", "caller"}, at)
            arguments = block.get("input", {})
            if not isinstance(arguments, dict):
                raise bad_request(f"{at}.input must be an object", f"{at}.input")
            calls.append({"id": expect_str(block.get("id"), f"{at}.id", allow_empty=False),
                          "type": "function",
                          "function": {"name": expect_str(block.get("name"), f"{at}.name",
                                                          allow_empty=False),
                                       "arguments": json.dumps(arguments)}})  # fmt: skip
        elif kind == "thinking":
            check_known(block, {"type", "thinking", "signature"}, at)
            thinking.append(expect_str(block.get("thinking"), f"{at}.thinking"))
        else:  # redacted_thinking: encrypted by Anthropic's models; never made here
            raise bad_request(f"{at}: redacted_thinking blocks come from Anthropic's models and "
                              "cannot be read here", at, "unsupported_content")  # fmt: skip
    if role == "user":
        if texts or not content:
            chat.add_message({"role": "user", "content": "\n".join(texts)}, where)
        return
    out: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        out["tool_calls"] = calls
    if thinking:
        out["reasoning_content"] = "\n".join(thinking)
    chat.add_message(out, where)


def _tool_result(block: dict[str, Any], at: str) -> dict[str, Any]:
    check_known(block, {"type", "tool_use_id", "content", "is_error", "cache_control"}, at)
    call_id = expect_str(block.get("tool_use_id"), f"{at}.tool_use_id", allow_empty=False)
    content = block.get("content", "")
    if isinstance(content, list):
        text = "\n".join(_text_block(b, f"{at}.content[{k}]") for k, b in enumerate(content))
    else:
        text = expect_str(content, f"{at}.content")
    if block.get("is_error") is True:
        text = "Error: " + text
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _tools(tools: Any, chat: ChatBody) -> None:
    if tools is None:
        return
    if not isinstance(tools, list):
        raise bad_request("tools must be a list of {name, description, input_schema}", "tools")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        tool = expect_object(tool, where, "a tool {name, description, input_schema}")
        if tool.get("type") not in (None, "custom"):
            raise bad_request(
                f"{where}.type {tool.get('type')!r}: Anthropic's server tools are not served "
                "here; give client tools {name, description, input_schema}",
                f"{where}.type",
                "unsupported_parameter",
            )
        check_known(tool, {"type", "name", "description", "input_schema", "cache_control",
                           "strict", "input_examples", "defer_loading"}, where)  # fmt: skip
        if "input_schema" not in tool:
            raise bad_request(f"{where}.input_schema is required (a JSON schema)",
                              f"{where}.input_schema")  # fmt: skip
        function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        for key in ("description", "strict"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        out.append({"type": "function", "function": function})
        chat.tool_sources.append(where)
    if out:
        chat.body["tools"] = out


def _tool_choice(choice: Any, chat: ChatBody) -> None:
    choice = expect_object(choice, "tool_choice", "an object {type: auto | any | tool | none}")
    kind = expect_choice(choice.get("type"), "tool_choice.type", ("auto", "any", "tool", "none"))
    check_known(choice, {"type", "name", "disable_parallel_tool_use"}, "tool_choice")
    if kind == "tool":
        name = expect_str(choice.get("name"), "tool_choice.name", allow_empty=False)
        chat.body["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        chat.body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    if choice.get("disable_parallel_tool_use") is not None:
        if not isinstance(choice["disable_parallel_tool_use"], bool):
            raise bad_request("tool_choice.disable_parallel_tool_use must be true or false",
                              "tool_choice.disable_parallel_tool_use")  # fmt: skip
        chat.body["parallel_tool_calls"] = not choice["disable_parallel_tool_use"]


def _thinking(thinking: Any, max_tokens: Any, chat: ChatBody) -> None:
    thinking = expect_object(thinking, "thinking", "{type: 'enabled', budget_tokens} or "
                             "{type: 'disabled'}")  # fmt: skip
    kind = expect_choice(thinking.get("type"), "thinking.type", ("enabled", "disabled",
                                                                 "adaptive"))  # fmt: skip
    check_known(thinking, {"type", "budget_tokens", "display"}, "thinking")
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1 or (
                isinstance(max_tokens, int) and budget >= max_tokens):  # fmt: skip
            raise bad_request(f"thinking.budget_tokens must be an integer in [1, max_tokens), "
                              f"got {budget!r}", "thinking.budget_tokens")  # fmt: skip
    if thinking.get("display") not in (None, "summarized"):
        raise bad_request("thinking.display 'omitted' is not supported: thinking is returned "
                          "whole", "thinking.display", "unsupported_parameter")  # fmt: skip
    kwargs = chat.body.setdefault("chat_template_kwargs", {})
    kwargs["enable_thinking"] = kind != "disabled"


def _output_config(config: Any, chat: ChatBody) -> None:
    config = expect_object(config, "output_config", "an object {effort, format}")
    check_known(config, {"effort", "format"}, "output_config")
    if config.get("effort") is not None:
        chat.body["reasoning_effort"] = config["effort"]
    fmt = config.get("format")
    if fmt is not None:
        fmt = expect_object(fmt, "output_config.format", "{type: 'json_schema', schema}")
        expect_choice(fmt.get("type"), "output_config.format.type", ("json_schema",))
        check_known(fmt, {"type", "schema"}, "output_config.format")
        chat.body["response_format"] = {"type": "json_schema",
                                        "json_schema": {"name": "output",
                                                        "schema": fmt.get("schema")}}  # fmt: skip


# ------------------------------------------------------------------ errors


def error_body(exc: APIError) -> dict[str, Any]:
    kind = ERROR_TYPES.get(exc.status, "api_error" if exc.status >= 500 else
                           "invalid_request_error")  # fmt: skip
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(error_body(exc), status_code=exc.status, headers=exc.headers)
