"""OpenAI's Responses API (`POST /v1/responses`), stateless, over the chat core.

A request becomes a chat body (chat_body.py): `instructions` the system message, `input` (a
string or items) the turns, `function_call` items an assistant turn's tool calls,
`function_call_output` items tool turns, `reasoning` items the next assistant turn's thinking;
Responses' flat function tools become Chat's nested ones, `text.format` the response_format,
`max_output_tokens` max_completion_tokens, `reasoning.effort` reasoning_effort.

Nothing is stored: `previous_response_id`, `conversation`, `store: true`, `background` and
`item_reference` inputs are refused with a 400 that says so; a client sends its whole history.
`reasoning.summary` and `include: ["reasoning.encrypted_content"]` are accepted: the reply's
reasoning items carry the model's whole thinking as `content` (reasoning_text), which is what a
stateless client sends back, and no summary.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from app.api.chat_body import (
    ChatBody,
    check_known,
    expect_choice,
    expect_object,
    expect_str,
    refuse_fields,
)
from app.api.errors import APIError, bad_request
from app.api.requests import GenerationPlan, Limits

ACCEPTED = frozenset({
    "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text",
    "max_output_tokens", "temperature", "top_p", "stream", "stream_options", "reasoning",
    "include", "truncation", "max_tool_calls",
    # harmless: they describe the caller, not the output
    "metadata", "user", "store", "service_tier", "prompt_cache_key", "safety_identifier",
    "prompt_cache_retention",
})  # fmt: skip

STATELESS = (
    "this server is stateless (it keeps no responses): send the whole conversation in `input`"
)
REFUSED = {
    "previous_response_id": STATELESS,
    "conversation": STATELESS,
    "background": "background responses need stored responses; " + STATELESS,
    "prompt": "stored prompt templates are not supported; send `instructions` and `input`",
    "top_logprobs": "logprobs are not supported on /v1/responses (use /v1/chat/completions)",
}
INCLUDABLE = ("reasoning.encrypted_content",)  # see the module docstring
ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text")

# chat field -> this API's field, for parse_chat's refusals
RENAMES = {
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
    "messages": "input",
}
SUFFIXES = {".function.": ".", ".tool_call_id": ".call_id"}  # Responses' tools are flat


@dataclass(slots=True)
class ResponsesCall:
    """A validated request: its chat plan and the request fields a Response object echoes."""

    plan: GenerationPlan
    echo: dict[str, Any] = field(default_factory=dict)


def parse_responses(body: Any, limits: Limits) -> ResponsesCall:
    """A /v1/responses body -> its chat plan (validated by parse_chat) and what the reply
    echoes; a 400 naming the Responses field for anything wrong or refused."""
    body = expect_object(body, "body", "a JSON object")
    refuse_fields(body, REFUSED)
    if body.get("store") is True:
        raise bad_request("store: true is not supported: " + STATELESS + "; send store: false "
                          "or leave it out", "store", "unsupported_parameter")  # fmt: skip
    check_known({k: v for k, v in body.items() if k not in REFUSED}, ACCEPTED)
    chat = ChatBody(renames=RENAMES, suffixes=SUFFIXES)
    for name in ("model", "temperature", "top_p", "stream", "parallel_tool_calls"):
        if body.get(name) is not None:
            chat.body[name] = body[name]
    if body.get("max_output_tokens") is not None:
        chat.body["max_completion_tokens"] = body["max_output_tokens"]
    _stream_options(body)
    _include(body.get("include"))
    if body.get("truncation") not in (None, "disabled"):
        raise bad_request(
            "truncation must be 'disabled': the server does not drop input items to fit the "
            f"context, got {body['truncation']!r}",
            "truncation",
        )
    instructions = body.get("instructions")
    if instructions is not None:
        chat.add_message({"role": "system", "content": expect_str(instructions, "instructions")},
                         "instructions")  # fmt: skip
    _input(body.get("input"), chat)
    tools, names = _tools(body.get("tools"), chat)
    choice = body.get("tool_choice")
    if choice is not None:
        chat.body["tool_choice"], tools = _tool_choice(choice, tools, names, chat)
    if tools:
        chat.body["tools"] = tools
    text = body.get("text")
    if text is not None:
        _text(expect_object(text, "text", "an object {format, verbosity}"), chat)
    reasoning = body.get("reasoning")
    if reasoning is not None:
        reasoning = expect_object(reasoning, "reasoning", "an object {effort, summary}")
        check_known(reasoning, {"effort", "summary", "generate_summary"}, "reasoning")
        for key in ("summary", "generate_summary"):  # no summaries: the thinking comes whole
            if reasoning.get(key) is not None:
                expect_choice(reasoning[key], f"reasoning.{key}", ("auto", "concise", "detailed"))
        if reasoning.get("effort") is not None:
            chat.body["reasoning_effort"] = reasoning["effort"]
    plan = chat.plan(limits)
    echo = {
        "instructions": instructions,
        "tools": body.get("tools") or [],
        "tool_choice": choice if choice is not None else "auto",
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {},
        "text": text if text is not None else {"format": {"type": "text"}},
        "reasoning": reasoning,
        "user": body.get("user"),
    }
    return ResponsesCall(plan=plan, echo=echo)


def parse_input_tokens(body: Any, limits: Limits) -> ResponsesCall:
    """`POST /v1/responses/input_tokens`: a Responses body (nothing is generated); the plan's
    messages, tools and template arguments are what gets counted."""
    body = expect_object(body, "body", "a JSON object")
    for name in ("max_output_tokens", "stream"):
        if name in body:
            raise bad_request(f"unknown field `{name}` (input_tokens generates nothing)", name,
                              "unknown_parameter")  # fmt: skip
    return parse_responses(body, limits)


def not_stored(response_id: str) -> APIError:
    """Every route about a stored response (retrieve, delete, cancel, input items)."""
    return APIError(404, f"no response {response_id!r}: {STATELESS}", param="response_id",
                    code="response_not_found")  # fmt: skip


# ------------------------------------------------------------------ request pieces


def _stream_options(body: dict[str, Any]) -> None:
    options = body.get("stream_options")
    if options is None:
        return
    if body.get("stream") is not True:
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")
    # include_obfuscation pads events with random text against length side channels; there
    # is no such padding here and nothing in an event depends on it.
    check_known(expect_object(options, "stream_options", "an object {include_obfuscation}"),
                {"include_obfuscation"}, "stream_options")  # fmt: skip


def _include(include: Any) -> None:
    if include is None:
        return
    if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
        raise bad_request("include must be a list of strings", "include")
    for x in include:
        if x not in INCLUDABLE:
            raise bad_request(f"include: {x!r} is not supported; allowed: {list(INCLUDABLE)}",
                              "include", "unsupported_parameter")  # fmt: skip


def _input(value: Any, chat: ChatBody) -> None:
    if isinstance(value, str):
        chat.add_message({"role": "user", "content": value}, "input")
        return
    if not isinstance(value, list) or not value:
        raise bad_request("input must be a string or a non-empty list of items", "input")
    pending_reasoning: str | None = None
    for i, item in enumerate(value):
        where = f"input[{i}]"
        item = expect_object(item, where, "an object (a message, function_call, "
                             "function_call_output or reasoning item)")  # fmt: skip
        kind = item.get("type", "message")  # EasyInputMessage has no type
        if kind == "message":
            check_known(item, {"type", "role", "content", "id", "status", "phase"}, where)
            role = expect_choice(item.get("role"), f"{where}.role", ROLES)
            message = {"role": role, "content": _text_of(item.get("content"), f"{where}.content")}
            if role == "assistant" and pending_reasoning is not None:
                message["reasoning_content"], pending_reasoning = pending_reasoning, None
            chat.add_message(message, where)
        elif kind == "function_call":
            check_known(item, {"type", "call_id", "name", "arguments", "id", "status",
                               "namespace", "caller"}, where)  # fmt: skip
            call = {
                "id": expect_str(item.get("call_id"), f"{where}.call_id", allow_empty=False),
                "type": "function",
                "function": {
                    "name": expect_str(item.get("name"), f"{where}.name", allow_empty=False),
                    "arguments": _arguments(item.get("arguments"), f"{where}.arguments"),
                },
            }
            last = chat.messages[-1] if chat.messages else None
            # a call after the assistant's text (or another call) is the same assistant turn
            if last is not None and last["role"] == "assistant" and pending_reasoning is None:
                last.setdefault("tool_calls", []).append(call)
            else:
                message = {"role": "assistant", "content": "", "tool_calls": [call]}
                if pending_reasoning is not None:
                    message["reasoning_content"], pending_reasoning = pending_reasoning, None
                chat.add_message(message, where)
        elif kind == "function_call_output":
            check_known(item, {"type", "call_id", "output", "id", "status"}, where)
            call_id = expect_str(item.get("call_id"), f"{where}.call_id", allow_empty=False)
            message = {"role": "tool", "tool_call_id": call_id,
                       "content": _text_of(item.get("output"), f"{where}.output")}  # fmt: skip
            chat.add_message(message, where)
        elif kind == "reasoning":
            check_known(item, {"type", "id", "summary", "content", "encrypted_content",
                               "status"}, where)  # fmt: skip
            texts = [p.get("text", "") for p in (item.get("content") or [])
                     if isinstance(p, dict)]  # fmt: skip
            if not texts:  # summaries stand in for thinking a client did not keep
                texts = [p.get("text", "") for p in (item.get("summary") or [])
                         if isinstance(p, dict)]  # fmt: skip
            pending_reasoning = "\n".join(t for t in texts if isinstance(t, str))
        elif kind == "item_reference":
            raise bad_request(f"{where}: item_reference needs stored items; {STATELESS}", where,
                              "unsupported_parameter")  # fmt: skip
        else:
            raise bad_request(f"{where}.type {kind!r} is not supported; allowed: message, "
                              "function_call, function_call_output, reasoning",
                              f"{where}.type")  # fmt: skip


def _text_of(content: Any, where: str) -> str:
    """A string, or text parts (input_text / output_text) joined; other parts are refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of input_text parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise bad_request(f"{where}[{j}]: {kind} parts are not supported (text-only model)",
                              f"{where}[{j}]", "unsupported_content")  # fmt: skip
        else:
            raise bad_request(f"{where}[{j}] must be {{'type': 'input_text', 'text': str}} "
                              f"(or output_text), got type {kind!r}", f"{where}[{j}]")  # fmt: skip
    return "\n".join(texts)


def _arguments(value: Any, where: str) -> str:
    text = expect_str(value, where)
    try:
        parsed = json.loads(text or "{}")
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        raise bad_request(f"{where} must be a JSON object's text, got {text[:80]!r}", where)
    return text or "{}"


def _tools(value: Any, chat: ChatBody) -> tuple[list[dict[str, Any]], list[str]]:
    if value is None:
        return [], []
    if not isinstance(value, list):
        raise bad_request("tools must be a list of function tools", "tools")
    tools, names = [], []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        tool = expect_object(tool, where, "a function tool {type: 'function', name, parameters}")
        if tool.get("type") != "function":
            raise bad_request(f"{where}.type must be 'function' (built-in tools such as web "
                              f"search are not served here), got {tool.get('type')!r}",
                              f"{where}.type", "unsupported_parameter")  # fmt: skip
        check_known(tool, {"type", "name", "description", "parameters", "strict",
                           "defer_loading"}, where)  # fmt: skip
        function = {"name": tool.get("name")}
        for key in ("description", "parameters", "strict"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        tools.append({"type": "function", "function": function})
        names.append(tool.get("name") if isinstance(tool.get("name"), str) else "")
        chat.tool_sources.append(where)
    return tools, names


def _tool_choice(
    choice: Any, tools: list[dict[str, Any]], names: list[str], chat: ChatBody
) -> tuple[Any, list[dict[str, Any]]]:
    """Responses' tool_choice -> Chat's (and the tools it leaves: allowed_tools narrows them)."""
    if isinstance(choice, str):
        return expect_choice(choice, "tool_choice", ("none", "auto", "required")), tools
    choice = expect_object(choice, "tool_choice", "'none', 'auto', 'required', {type: "
                           "'function', name} or {type: 'allowed_tools', mode, tools}")  # fmt: skip
    kind = choice.get("type")
    if kind == "function":
        check_known(choice, {"type", "name"}, "tool_choice")
        return {"type": "function", "function": {"name": choice.get("name")}}, tools
    if kind == "allowed_tools":
        check_known(choice, {"type", "mode", "tools"}, "tool_choice")
        mode = expect_choice(choice.get("mode"), "tool_choice.mode", ("auto", "required"))
        allowed = choice.get("tools")
        if not isinstance(allowed, list) or not allowed:
            raise bad_request("tool_choice.tools must be a non-empty list of {type: 'function', "
                              "name}", "tool_choice.tools")  # fmt: skip
        keep = set()
        for j, a in enumerate(allowed):
            name = a.get("name") if isinstance(a, dict) else None
            if name not in names:
                raise bad_request(f"tool_choice.tools[{j}] names no function in tools: {name!r}"
                                  f"; tools: {names}", f"tool_choice.tools[{j}]")  # fmt: skip
            keep.add(name)
        kept = [i for i, n in enumerate(names) if n in keep]
        chat.tool_sources = [chat.tool_sources[i] for i in kept]
        return mode, [tools[i] for i in kept]
    raise bad_request(f"tool_choice.type must be 'function' or 'allowed_tools', got {kind!r}",
                      "tool_choice.type", "unsupported_parameter")  # fmt: skip


def _text(text: dict[str, Any], chat: ChatBody) -> None:
    check_known(text, {"format", "verbosity"}, "text")
    if text.get("verbosity") not in (None, "medium"):
        raise bad_request("text.verbosity is not supported (the model has one verbosity)",
                          "text.verbosity", "unsupported_parameter")  # fmt: skip
    fmt = text.get("format")
    if fmt is None:
        return
    fmt = expect_object(fmt, "text.format", "{type: 'text' | 'json_object' | 'json_schema'}")
    kind = expect_choice(fmt.get("type"), "text.format.type", ("text", "json_object",
                                                                "json_schema"))  # fmt: skip
    if kind == "json_schema":
        check_known(fmt, {"type", "name", "schema", "description", "strict"}, "text.format")
        spec = {k: fmt[k] for k in ("name", "schema", "description", "strict") if k in fmt}
        chat.body["response_format"] = {"type": "json_schema", "json_schema": spec}
    else:
        check_known(fmt, {"type"}, "text.format")
        chat.body["response_format"] = {"type": kind}
