"""The tool and template fields of a chat request -> the plan (400 naming the field).

`tools` are OpenAI function tools; `tool_choice` "auto" (the default with tools), "none" (the
default without; the tools are then not rendered at all, so the model answers in prose, which is
what a caller that says "none" expects), "required" or {"type": "function", "function": {"name"}}
(both forced through structured output, forced.py); `parallel_tool_calls` (true by default)
allows more than one forced call. `chat_template_kwargs` go to the chat template as they are;
`reasoning_effort` joins them (templates such as gpt-oss's read it).
"""

from __future__ import annotations

import json
import re
from typing import Any

from app.api.errors import bad_request
from app.api.tools.forced import forced_structured

TOOL_CHOICES = ("auto", "none", "required")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")
# OpenAI's rule for function names
NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
MESSAGE_FIELDS = frozenset({"tool_calls", "tool_call_id", "reasoning_content", "reasoning"})


def parse_tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("tools must be a list of {type: 'function', function: {name, "
                          "description, parameters}}", "tools")  # fmt: skip
    out, names = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad_request(f"{where}.type must be 'function' (the only tool type served)",
                              f"{where}.type")  # fmt: skip
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise bad_request(f"{where}.function must be an object {{name, description, "
                              "parameters}", f"{where}.function")  # fmt: skip
        name = fn.get("name")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise bad_request(f"{where}.function.name must be 1-64 letters, digits, '_', '.' or "
                              f"'-', got {name!r}", f"{where}.function.name")  # fmt: skip
        if name in names:
            raise bad_request(f"{where}.function.name {name!r} is given twice",
                              f"{where}.function.name")  # fmt: skip
        names.add(name)
        params = fn.get("parameters")
        if params is not None and not (isinstance(params, dict) and
                                       params.get("type", "object") == "object"):  # fmt: skip
            raise bad_request(f"{where}.function.parameters must be a JSON schema of an object",
                              f"{where}.function.parameters")  # fmt: skip
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise bad_request(f"{where}.function.description must be a string",
                              f"{where}.function.description")  # fmt: skip
        clean: dict[str, Any] = {"name": name}
        if desc is not None:
            clean["description"] = desc
        clean["parameters"] = params if params is not None else {"type": "object",
                                                                 "properties": {}}  # fmt: skip
        out.append({"type": "function", "function": clean})
    return out or None


def parse_tool_choice(body: dict[str, Any], tools: list[dict[str, Any]] | None) -> str | dict:
    choice = body.get("tool_choice")
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise bad_request(f"tool_choice must be one of {list(TOOL_CHOICES)} or "
                              "{'type': 'function', 'function': {'name': ...}}, got "
                              f"{choice!r}", "tool_choice")  # fmt: skip
        if choice == "required" and not tools:
            raise bad_request("tool_choice 'required' needs tools", "tool_choice")
        return choice
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not (
        isinstance(choice, dict) and choice.get("type") == "function" and isinstance(name, str)
    ):
        raise bad_request("tool_choice must be 'auto', 'none', 'required' or {'type': "
                          "'function', 'function': {'name': ...}}", "tool_choice")  # fmt: skip
    known = [t["function"]["name"] for t in tools or []]
    if name not in known:
        raise bad_request(f"tool_choice names the function {name!r}, which is not in tools "
                          f"({known})", "tool_choice.function.name")  # fmt: skip
    return {"type": "function", "function": {"name": name}}


def parse_template_kwargs(body: dict[str, Any]) -> dict[str, Any] | None:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not (isinstance(kwargs, dict) and all(isinstance(k, str)
                                                                    for k in kwargs)):  # fmt: skip
        raise bad_request("chat_template_kwargs must be an object of template variables (e.g. "
                          "{'enable_thinking': false})", "chat_template_kwargs")  # fmt: skip
    kwargs = dict(kwargs or {})
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise bad_request(f"reasoning_effort must be one of {list(REASONING_EFFORTS)}, got "
                              f"{effort!r}", "reasoning_effort")  # fmt: skip
        kwargs.setdefault("reasoning_effort", effort)
    return kwargs or None


def apply_tools(plan: Any, body: dict[str, Any]) -> None:
    """Fill the plan's tool and template fields (after its sampling options are set)."""
    plan.tools = parse_tools(body)
    plan.tool_choice = parse_tool_choice(body, plan.tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request(f"parallel_tool_calls must be true or false, got {parallel!r}",
                          "parallel_tool_calls")  # fmt: skip
    plan.parallel_tool_calls = True if parallel is None else parallel
    plan.chat_template_kwargs = parse_template_kwargs(body)
    if plan.tools and plan.tool_choice not in ("auto", "none"):
        if plan.sampling.structured is not None:
            raise bad_request(f"tool_choice {plan.tool_choice!r} forces the output's shape and "
                              "cannot be combined with response_format or structured_outputs",
                              "tool_choice")  # fmt: skip
        plan.sampling.structured = forced_structured(plan.tools, plan.tool_choice,
                                                     plan.parallel_tool_calls)  # fmt: skip


def message_tool_fields(m: dict[str, Any], role: str, where: str,
                        names: dict[str, str]) -> dict[str, Any]:  # fmt: skip
    """An assistant turn's `tool_calls` (arguments JSON text -> an object, as chat templates
    read them) and reasoning, a tool turn's `tool_call_id` and `name` -> ChatMessage fields.
    `names` maps call ids seen so far to their function names (a tool turn without `name`
    gets its call's)."""
    out: dict[str, Any] = {}
    calls = m.get("tool_calls")
    if calls is not None:
        if role != "assistant" or not isinstance(calls, list):
            raise bad_request(f"{where}.tool_calls must be a list, on an assistant message",
                              f"{where}.tool_calls")  # fmt: skip
        out["tool_calls"] = [_call(c, f"{where}.tool_calls[{j}]", names)
                             for j, c in enumerate(calls)] or None  # fmt: skip
    reasoning = m.get("reasoning_content", m.get("reasoning"))
    if reasoning is not None:
        if role != "assistant" or not isinstance(reasoning, str):
            raise bad_request(f"{where}.reasoning_content must be a string, on an assistant "
                              "message", f"{where}.reasoning_content")  # fmt: skip
        out["reasoning_content"] = reasoning
    call_id = m.get("tool_call_id")
    if role == "tool":
        if not isinstance(call_id, str) or not call_id:
            raise bad_request(f"{where}.tool_call_id must be the id of the call this message "
                              "answers (a string)", f"{where}.tool_call_id")  # fmt: skip
        out["tool_call_id"] = call_id
        name = m.get("name")
        out["name"] = name if isinstance(name, str) and name else names.get(call_id)
    elif call_id is not None:
        raise bad_request(f"{where}.tool_call_id is only for role 'tool' messages",
                          f"{where}.tool_call_id")  # fmt: skip
    return out


def _call(call: Any, where: str, names: dict[str, str]) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or call.get("type", "function") != "function":
        raise bad_request(f"{where} must be {{id, type: 'function', function: {{name, "
                          "arguments}}}", where)  # fmt: skip
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(f"{where}.function.name must be a non-empty string",
                          f"{where}.function.name")  # fmt: skip
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError as exc:
            raise bad_request(f"{where}.function.arguments is not valid JSON ({exc})",
                              f"{where}.function.arguments") from None  # fmt: skip
    if not isinstance(args, dict):
        raise bad_request(f"{where}.function.arguments must be a JSON object",
                          f"{where}.function.arguments")  # fmt: skip
    call_id = call.get("id")
    if call_id is not None and not isinstance(call_id, str):
        raise bad_request(f"{where}.id must be a string", f"{where}.id")
    if call_id:
        names[call_id] = name
    out: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": args}}
    if call_id:
        out["id"] = call_id
    return out


def apply_model(plan: Any, info: Any, tool_call_parser: str | None) -> None:
    """How this server reads the plan's replies: the tool family (the server's flag, else what
    the engine detected in the template, else hermes) and thinking (ModelInfo.reasoning_parser;
    the block starts open when the template opens it, unless the request turned thinking off)."""
    from app.api.tools import DEFAULT_FAMILY, family

    plan.tool_parser = family(
        tool_call_parser or getattr(info, "tool_parser", "") or DEFAULT_FAMILY
    ).name
    kind = getattr(info, "reasoning_parser", "")
    plan.reasoning = bool(kind)
    thinking = (plan.chat_template_kwargs or {}).get("enable_thinking", True)
    plan.reasoning_open = kind == "think_open" and thinking is not False
