"""app/api/tools/request.py through parse_chat: tools, tool_choice, tool history and template
arguments -> the plan; every bad one a 400 naming the field."""

from __future__ import annotations

import json

import pytest

from app.api.errors import APIError
from app.api.requests import Limits, parse_chat, parse_tokenize
from app.api.tools.request import apply_model
from ipc import protocol as P

LIMITS = Limits(max_model_len=512, max_tokens=512)
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "weather", "parameters": CITY},
}
USER = {"role": "user", "content": "weather in Paris?"}


def chat(**body: object):
    return parse_chat({"messages": [USER], **body}, LIMITS)


def test_tools_auto_by_default_and_none_without_tools() -> None:
    plan = chat(tools=[WEATHER])
    assert (plan.tools, plan.tool_choice, plan.parallel_tool_calls) == ([WEATHER], "auto", True)
    assert plan.sampling.structured is None
    assert chat().tool_choice == "none" and chat().tools is None


def test_required_and_named_choices_are_forced_with_their_schema() -> None:
    plan = chat(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    s = plan.sampling.structured
    assert (s.kind, s.field) == ("json", "tool_choice")
    schema = json.loads(s.spec)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    assert schema["items"]["properties"]["parameters"] == WEATHER["function"]["parameters"]
    named = chat(tools=[WEATHER], tool_choice={"type": "function",
                                               "function": {"name": "get_weather"}})  # fmt: skip
    assert named.sampling.structured is not None


def test_a_tool_history_becomes_template_messages() -> None:
    plan = parse_chat({"messages": [
        USER,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ], "tools": [WEATHER]}, LIMITS)  # fmt: skip
    a, t = plan.messages[1], plan.messages[2]
    assert a.content == "" and a.tool_calls == [{"id": "call_1", "type": "function", "function":
                                                 {"name": "get_weather", "arguments":
                                                  {"city": "Paris"}}}]  # fmt: skip
    assert (t.role, t.tool_call_id, t.name, t.content) == ("tool", "call_1", "get_weather", "18 C")


def test_template_kwargs_and_reasoning_effort() -> None:
    plan = chat(chat_template_kwargs={"enable_thinking": False}, reasoning_effort="low")
    assert plan.chat_template_kwargs == {"enable_thinking": False, "reasoning_effort": "low"}
    tok = parse_tokenize({"messages": [USER], "tools": [WEATHER],
                          "chat_template_kwargs": {"x": 1}})  # fmt: skip
    assert tok["tools"] == [WEATHER] and tok["chat_template_kwargs"] == {"x": 1}


def test_the_model_decides_the_parser_and_thinking() -> None:
    plan = chat(tools=[WEATHER])
    info = P.ModelInfo(name="m", architecture="a", num_layers=1, num_kv_heads=1, head_dim=1,
                       dtype="f", device="cpu", block_size=16, num_blocks=1,
                       kv_bytes_per_token=1, max_model_len=8, tool_parser="mistral",
                       reasoning_parser="think_open")  # fmt: skip
    apply_model(plan, info, None)
    assert (plan.tool_parser, plan.reasoning, plan.reasoning_open) == ("mistral", True, True)
    apply_model(plan, info, "qwen3")  # the server's flag wins (vLLM's alias)
    assert plan.tool_parser == "hermes"
    off = chat(chat_template_kwargs={"enable_thinking": False})
    apply_model(off, info, None)
    assert (off.reasoning, off.reasoning_open) == (True, False)


BAD = [
    ({"tools": {"a": 1}}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"description": "x"}}]},
     "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
     "tools[0].function.parameters"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type":
      "function", "function": {"name": "f", "arguments": "{bad"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]},
     "messages[0].tool_calls[0].function.name"),
    ({"messages": [{"role": "tool", "content": "18 C"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]},
     "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "param"), BAD)
def test_bad_tool_fields_are_400_naming_the_field(body, param) -> None:
    with pytest.raises(APIError) as info:
        parse_chat({"messages": [USER], **body}, LIMITS)
    assert info.value.status == 400 and info.value.param == param, info.value.message
