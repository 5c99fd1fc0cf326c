"""Chat messages -> prompt text through the checkpoint's chat template, with tools.

Tools go to `tokenizer.apply_chat_template(tools=...)` with the request's template arguments
(`enable_thinking`, `reasoning_effort`, ...). A template that does not read `tools` (no "tools"
in its source: SmolLM2's, for one) gets the documented fallback, Hermes's convention:

- the tools are described in a system message (prepended, or appended to the first system
  message), as JSON inside `<tools>...</tools>`, with the instruction to answer a call as
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
- an assistant turn's earlier calls are written into its content in that form;
- a tool turn becomes a user turn `<tool_response>...</tool_response>` (templates without tool
  support often refuse the `tool` role).

The API reads calls with the family `tool_parser_of` names (hermes for the fallback).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

FALLBACK_INSTRUCTIONS = (
    "You may call one or more functions to answer the user. The functions, as JSON schemas:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call a function, answer with one block per call, and nothing else:\n"
    '<tool_call>\n{{"name": <function name>, "arguments": <the arguments as a JSON object>}}\n'
    "</tool_call>"
)


@dataclass(slots=True)
class ChatPrompt:
    """A chat prompt with what the template needs besides the messages."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def message_dicts(messages: Any) -> list[dict[str, Any]]:
    """ipc ChatMessages -> the dicts templates read (optional fields only when set)."""
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        for name in ("tool_calls", "tool_call_id", "name", "reasoning_content"):
            value = getattr(m, name, None)
            if value is not None:
                d[name] = value
        out.append(d)
    return out


def check_tools(tools: Any) -> None:
    """ValueError naming the field unless tools are [{type: function, function: {name, ...}}]."""
    if not isinstance(tools, list):
        raise ValueError("tools must be a list of {'type': 'function', 'function': {...}}")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{name, "
                             "parameters}}}")  # fmt: skip
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tools[{i}].function.name must be a non-empty string")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")


def supports_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template  # type: ignore[operator]


def render(tokenizer: Any, prompt: ChatPrompt, add_generation_prompt: bool = True) -> str:
    kwargs = dict(prompt.chat_template_kwargs or {})
    for reserved in ("messages", "tools", "add_generation_prompt", "tokenize"):
        if reserved in kwargs:
            raise ValueError(f"chat_template_kwargs must not set {reserved!r}")
    messages, tools = prompt.messages, prompt.tools
    if tools is not None:
        check_tools(tools)
    template = template_of(tokenizer)
    if tools and not supports_tools(template):
        messages, tools = fallback_messages(messages, tools), None
    elif not supports_tools(template):
        messages = fallback_messages(messages, [])
    if tools:
        kwargs["tools"] = tools
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )


def fallback_messages(messages: list[dict[str, Any]],
                      tools: list[dict[str, Any]]) -> list[dict[str, Any]]:  # fmt: skip
    """The Hermes-convention rewrite for a template without tool support (module docstring);
    with no tools, only the history's calls and results are rewritten."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m["role"], m["content"]
        if m.get("tool_calls"):
            blocks = [json.dumps({"name": c["function"]["name"],
                                  "arguments": c["function"].get("arguments", {})})
                      for c in m["tool_calls"]]  # fmt: skip
            text = "".join(f"<tool_call>\n{b}\n</tool_call>" for b in blocks)
            content = f"{content}\n{text}" if content else text
        if role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": role, "content": content})
    if tools:
        described = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        text = FALLBACK_INSTRUCTIONS.format(tools=described)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def template_of(tokenizer: Any) -> str | None:
    """The chat template's text (the default one of a dict of named templates)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return template if isinstance(template, str) else None


def tool_parser_of(tokenizer: Any) -> str:
    """The family whose syntax the template teaches (app/api/tools/ reads it)."""
    t = template_of(tokenizer) or ""
    if not supports_tools(t) or "<tool_call>" in t:
        return "hermes"  # Hermes, Qwen 2.5 / 3, and the fallback
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "func_name1(" in t or "<|python_start|>" in t:
        return "pythonic"
    if "<|python_tag|>" in t or "ipython" in t:
        return "llama3_json"
    return "hermes"


def reasoning_parser_of(tokenizer: Any) -> str:
    """ "" (no thinking markers), "think" (the reply opens `<think>`) or "think_open" (the
    generation prompt already opened it, DeepSeek-R1 style)."""
    template = template_of(tokenizer)
    if template is None or "<think>" not in template:
        return ""
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=True
        )
    except Exception:  # a template that needs more than one user turn: assume the plain kind
        return "think"
    return "think_open" if text.rstrip().endswith("<think>") else "think"
