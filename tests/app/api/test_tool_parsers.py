"""app/api/tools/ and app/api/reasoning.py on recorded outputs of each family: whole reading,
malformed and truncated calls (content, nothing lost, nothing raised), and streaming split at
every character position equal to whole reading."""

from __future__ import annotations

import json

import pytest

from app.api.chat_output import (
    ChoiceReader,
    ContentDelta,
    ReasoningDelta,
    ToolCallArguments,
    ToolCallStart,
)
from app.api.requests import GenerationPlan
from app.api.tools.forced import forced_schema, read_forced

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}},
]  # fmt: skip

# (family, model output, expected content, expected [(name, arguments dict)])
RECORDED = [
    # Qwen2.5-7B-Instruct
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
     '"Paris"}}\n</tool_call>', "Let me check.\n", [("get_weather", {"city": "Paris"})]),
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
     "\n", [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo"})]),
    ("hermes", "No tools needed: 2 < 3 and <tool is a word.", "No tools needed: 2 < 3 and "
     "<tool is a word.", []),
    # closing tag cut by a stop string, JSON whole: still a call
    ("hermes", '<tool_call>{"name": "add", "arguments": "{\\"a\\": 5}"}', "", [("add", {"a": 5})]),
    # malformed JSON: content
    ("hermes", 'x <tool_call>{"name": "add", "arguments": {a: 1}}</tool_call> y',
     'x <tool_call>{"name": "add", "arguments": {a: 1}}</tool_call> y', []),
    # truncated by max_tokens
    ("hermes", 'ok <tool_call>\n{"name": "get_weather", "argu',
     'ok <tool_call>\n{"name": "get_weather", "argu', []),
    # no name
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}'
     "</tool_call>", []),
    # Llama-3.1-8B-Instruct
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Rome"}}', "",
     [("get_weather", {"city": "Rome"})]),
    ("llama3_json", '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "add", '
     '"parameters": {"b": 2}}', "", [("add", {"a": 1}), ("add", {"b": 2})]),
    ("llama3_json", '  {"answer": 42}', '  {"answer": 42}', []),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1', '{"name": "add", "parameters": '
     '{"a": 1', []),
    ("llama3_json", "The weather is {fine}.", "The weather is {fine}.", []),
    # Mistral-7B-Instruct-v0.3, and the v11 format
    ("mistral", 'Sure.[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]', "Sure.",
     [("add", {"a": 1, "b": 2})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Lima"}[TOOL_CALLS]add[ARGS]{"a": 3}', "",
     [("get_weather", {"city": "Lima"}), ("add", {"a": 3})]),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a"', '[TOOL_CALLS][{"name": "add", '
     '"arguments": {"a"', []),
    ("mistral", "[TOOL maybe", "[TOOL maybe", []),
    # Llama-3.2-3B-Instruct (pythonic)
    ("pythonic", '[get_weather(city="San Francisco"), add(a=1, b=2)]', "",
     [("get_weather", {"city": "San Francisco"}), ("add", {"a": 1, "b": 2})]),
    ("pythonic", "<|python_start|>[add(a=[1, 2], b={'k': None})]<|python_end|>", "",
     [("add", {"a": [1, 2], "b": {"k": None}})]),
    ("pythonic", "[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),
    ("pythonic", '[get_weather(city="Par', '[get_weather(city="Par', []),
    ("pythonic", "[os.system(cmd=__import__('os'))]", "[os.system(cmd=__import__('os'))]", []),
]  # fmt: skip


def plan(family: str = "hermes", **kw: object) -> GenerationPlan:
    return GenerationPlan(kind="chat", model="", tools=TOOLS, tool_parser=family, **kw)


def read(p: GenerationPlan, pieces: list[str]) -> tuple[list, object]:
    r = ChoiceReader(p)
    events = []
    for piece in pieces:
        events += r.feed(piece)
    events += r.finish()
    return events, r.output()


def normalized(events: list) -> list:
    """Merge adjacent deltas of one kind; call ids replaced by their index."""
    out: list = []
    for e in events:
        if isinstance(e, ToolCallStart):
            out.append(("start", e.index, e.name))
        elif isinstance(e, ToolCallArguments):
            out.append(("args", e.index, e.text))
        else:
            kind = "content" if isinstance(e, ContentDelta) else "reasoning"
            if out and out[-1][0] == kind:
                out[-1] = (kind, out[-1][1] + e.text)
            elif e.text:
                out.append((kind, e.text))
    return out


@pytest.mark.parametrize(("family", "text", "content", "calls"), RECORDED)
def test_recorded_outputs_read_whole(family, text, content, calls) -> None:
    events, out = read(plan(family), [text])
    assert out.content == content
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == calls
    assert all(c.id.startswith("call_") for c in out.tool_calls)
    if not calls:  # nothing lost: every character came back
        assert out.content == text
    # the events say the same thing as the output
    assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == content


@pytest.mark.parametrize(("family", "text", "content", "calls"), RECORDED)
def test_streaming_split_anywhere_equals_whole(family, text, content, calls) -> None:
    whole = normalized(read(plan(family), [text])[0])
    for i in range(len(text) + 1):
        assert normalized(read(plan(family), [text[:i], text[i:]])[0]) == whole, i
    assert normalized(read(plan(family), list(text))[0]) == whole


def test_auto_never_streams_part_of_a_marker_or_a_call() -> None:
    text = RECORDED[0][1]
    r = ChoiceReader(plan())
    streamed = ""
    for ch in text:
        for e in r.feed(ch):
            if isinstance(e, ContentDelta):
                streamed += e.text
        assert "<" not in streamed
    assert streamed == "Let me check.\n"


def test_tool_choice_none_and_no_tools_read_everything_as_content() -> None:
    text = RECORDED[0][1]
    for p in (plan(tool_choice="none"), GenerationPlan(kind="chat", model="")):
        _, out = read(p, [text])
        assert (out.content, out.tool_calls) == (text, [])


# ------------------------------------------------------------------ forced choices


def test_forced_schema_required_and_named() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    required = forced_schema(TOOLS, "required", parallel=True)
    named = forced_schema(TOOLS, {"type": "function", "function": {"name": "add"}}, False)
    good = [{"name": "get_weather", "parameters": {"city": "x"}}, {"name": "add", "parameters":
            {"a": 1}}]  # fmt: skip
    jsonschema.validate(good, required)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "nope",
                "parameters": {}}], [{"name": "add"}]):  # fmt: skip
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, required)
    jsonschema.validate([{"name": "add", "parameters": {"a": 2}}], named)
    for bad in (good, [good[0]], [good[1], good[1]]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, named)
    assert named["maxItems"] == 1 and "maxItems" not in required


def test_forced_output_reads_as_calls_and_bad_output_as_content() -> None:
    text = '[{"name": "add", "parameters": {"a": 1, "b": 2}}]'
    assert [(c.name, json.loads(c.arguments)) for c in read_forced(text)] == [
        ("add", {"a": 1, "b": 2})
    ]
    p = plan(tool_choice="required")
    events, out = read(p, list(text))
    assert [type(e) for e in events] == [ToolCallStart, ToolCallArguments]
    assert out.content == "" and out.tool_calls[0].name == "add"
    for bad in ('[{"name": "add", "parameters": {"a"', "hello", '{"name": "add"}'):
        _, out = read(p, list(bad))
        assert (out.content, out.tool_calls) == (bad, [])


# ------------------------------------------------------------------ reasoning

THINK = [
    # (reply, starts inside the block, reasoning, content)
    ("<think>\nLet me add.\n</think>\n\nIt is 3.", False, "\nLet me add.\n", "\n\nIt is 3."),
    ("It is 3.", False, None, "It is 3."),
    ("Let me add.\n</think>\n\nIt is 3.", True, "Let me add.\n", "\n\nIt is 3."),
    ("<think>\n\n</think>\n\nIt is 3.", False, "\n\n", "\n\nIt is 3."),
    ("<think>never closed", False, "never closed", ""),
    ("a < b <thin", False, None, "a < b <thin"),
    ("<think>x</think>y<think>z</think>", False, "x", "y<think>z</think>"),
]  # fmt: skip


@pytest.mark.parametrize(("text", "inside", "reasoning", "content"), THINK)
def test_reasoning_split_exactly_streamed_or_not(text, inside, reasoning, content) -> None:
    p = GenerationPlan(kind="chat", model="", reasoning=True, reasoning_open=inside)
    for i in range(len(text) + 1):
        events, out = read(p, [text[:i], text[i:]])
        assert (out.reasoning, out.content) == (reasoning, content), i
        streamed = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
        assert streamed == (reasoning or "")
        assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == content


def test_reasoning_then_a_tool_call() -> None:
    p = plan(reasoning=True)
    text = '<think>call add</think><tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    r = ChoiceReader(p)
    for ch in text:
        r.feed(ch, num_tokens=1)
    r.finish()
    out = r.output()
    assert (out.reasoning, out.content, out.tool_calls[0].name) == ("call add", "", "add")
    assert out.reasoning_tokens == len("<think>call add</think>") - len("<think")
