"""Pythonic calls (Llama 3.2 / 4 small models, vLLM's `pythonic` parser): the reply is a Python
list of calls with keyword arguments, `[get_weather(city="Paris"), add(a=1, b=2)]`, optionally
inside `<|python_start|>` ... `<|python_end|>`. Arguments must be literals (read with
`ast.literal_eval`, never evaluated)."""

from __future__ import annotations

import ast
import json

from app.api.tools.base import Family, ParsedCall

START, END = "<|python_start|>", "<|python_end|>"


def read(region: str) -> list[ParsedCall] | None:
    body = region.strip()
    if body.startswith(START):
        body = body[len(START) :]
    body = body.removesuffix(END).strip()
    try:
        tree = ast.parse(body, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args:
            return None
        name = _dotted(node.func)
        if name is None:
            return None
        args = {}
        for kw in node.keywords:
            if kw.arg is None:
                return None
            try:
                args[kw.arg] = ast.literal_eval(kw.value)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                return None
        try:
            text = json.dumps(args, ensure_ascii=False)
        except (TypeError, ValueError):  # a set, bytes, ...: not JSON
            return None
        calls.append(ParsedCall(name, text))
    return calls


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


FAMILY = Family("pythonic", (START,), "[", None, read)
