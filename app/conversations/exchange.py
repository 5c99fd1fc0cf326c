"""Conversations in and out: Markdown to read or share, and the OpenAI chat `messages` list that
other tools (and the OpenAI API itself) take. Only the branch on screen is exported; an import
is one chain."""

from __future__ import annotations

from typing import Any

from app.conversations.model import Conversation, Message

MAX_IMPORT_MESSAGES = 10_000
IMPORT_ROLES = ("system", "developer", "user", "assistant")
UNSUPPORTED_KEYS = ("tool_calls", "function_call", "audio")  # an assistant turn that did more


def to_markdown(conv: Conversation) -> str:
    """The title, the system prompt, then each turn under `## You` / `## Assistant`; text is
    copied verbatim (it usually is Markdown already)."""
    out = [f"# {conv.title}"]
    if conv.system_prompt.strip():
        out.append(f"## System prompt\n\n{conv.system_prompt}")
    for m in conv.messages:
        if m.role == "assistant" and not m.content:
            continue  # a reply stopped before its first token
        heading = {"user": "You", "assistant": "Assistant", "system": "System"}[m.role]
        section = f"## {heading}\n\n{m.content}"
        if m.attachments:
            section += "\n\nAttached:\n" + "\n".join(_attachment_line(a) for a in m.attachments)
        out.append(section)
    return "\n\n".join(out) + "\n"


def _attachment_line(a: dict) -> str:
    tokens = f" ({a['tokens']} tokens)" if a.get("tokens") is not None else ""
    return f"- `{a['name']}`{tokens}"


def to_openai_messages(conv: Conversation) -> list[dict]:
    """`messages` for the OpenAI chat API: the system prompt, then the branch on screen with
    attached files inlined, exactly as the engine is sent it."""
    return [{"role": m["role"], "content": m["content"]} for m in conv.to_prompt()]


def from_openai_messages(data: Any, title: str | None = None) -> Conversation:
    """A conversation from an OpenAI `messages` list, or an object {"messages": [...], "title"}.

    Text only: tool turns, images and the like are refused with a ValueError naming the index
    and field. A system (or developer) message may only come first; it becomes the system
    prompt."""
    messages, title = _unwrap(data, title)
    system_prompt = ""
    turns: list[Message] = []
    for i, m in enumerate(messages):
        role, content = _turn(m, i)
        if role in ("system", "developer"):
            if i:
                raise ValueError(f"messages[{i}].role {role!r}: a system or developer message "
                                 "may only come first")  # fmt: skip
            system_prompt = content
        else:
            turns.append(Message(role, content))
    conv = Conversation(title=title or "Imported chat", system_prompt=system_prompt,
                        messages=turns)  # fmt: skip
    if not title:
        conv.title = conv.auto_title()  # the first user turn, as for a chat typed here
    return conv


def _unwrap(data: Any, title: str | None) -> tuple[list, str | None]:
    if isinstance(data, dict):
        if not isinstance(data.get("messages"), list):
            raise ValueError("messages must be a list of chat messages")
        given = data.get("title")
        if given is not None and not isinstance(given, str):
            raise ValueError(f"title must be a string, got {type(given).__name__}")
        title, data = title or given, data["messages"]
    if not isinstance(data, list):
        raise ValueError("expected a list of chat messages or an object with 'messages', "
                         f"got {type(data).__name__}")  # fmt: skip
    if len(data) > MAX_IMPORT_MESSAGES:
        raise ValueError(f"messages: {len(data)} messages, at most {MAX_IMPORT_MESSAGES} allowed")
    return data, title


def _turn(m: Any, i: int) -> tuple[str, str]:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise ValueError(f"{where} must be an object {{role, content}}, got {type(m).__name__}")
    role = m.get("role")
    if role not in IMPORT_ROLES:
        raise ValueError(
            f"{where}.role {role!r} is not supported: allowed {', '.join(IMPORT_ROLES)}"
        )
    for key in UNSUPPORTED_KEYS:
        if m.get(key):
            raise ValueError(f"{where}.{key} is not supported: text messages only")
    if "content" not in m:
        raise ValueError(f"{where}.content is missing: allowed a string or a list of text parts")
    return role, _text(m["content"], f"{where}.content")


def _text(content: Any, where: str) -> str:
    """A string, or text parts joined with newlines (as the project's API server does)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where} must be a string or a list of text parts, "
                         f"got {type(content).__name__}")  # fmt: skip
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise ValueError(f"{where}[{j}].type {kind!r} is not supported: allowed 'text'")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{where}[{j}].text must be a string")
        texts.append(part["text"])
    return "\n".join(texts)
