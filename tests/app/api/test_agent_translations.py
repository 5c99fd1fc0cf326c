"""The Responses and Messages APIs without a server: request bodies -> chat plans, ChoiceEvents
-> their stream events and bodies, checked against the official SDKs' own types (pydantic
validation, stricter than the SDKs' parsing) and their stream accumulators.

The chat core's reader (chat_output.ChoiceReader) is not needed here: the encoders consume
ChoiceEvents, which the tests write down directly.
"""

from __future__ import annotations

import json

import pytest

from app.api.agent_runs import ChoiceResult, ChoiceRun
from app.api.anthropic_messages import parse_messages
from app.api.chat_output import (
    ChoiceOutput,
    ContentDelta,
    ReasoningDelta,
    ToolCall,
    ToolCallArguments,
    ToolCallStart,
)
from app.api.errors import APIError
from app.api.messages_stream import MessagesEncoder
from app.api.openai_responses import parse_responses
from app.api.requests import Limits
from app.api.responses_stream import ResponsesEncoder
from ipc import protocol as P

LIMITS = Limits(max_model_len=512, max_tokens=512)
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}

# One choice that thinks, talks, then calls a tool, as the reader would stream it.
EVENTS = [
    ReasoningDelta("Let me "), ReasoningDelta("think."),
    ContentDelta("Checking"), ContentDelta(" the weather."),
    ToolCallStart(0, "call_abc", "get_weather"),
    ToolCallArguments(0, '{"city": '), ToolCallArguments(0, '"Paris"}'),
]  # fmt: skip
OUTPUT = ChoiceOutput(
    content="Checking the weather.",
    reasoning="Let me think.",
    tool_calls=[ToolCall("call_abc", "get_weather", '{"city": "Paris"}')],
    reasoning_tokens=3,
)


def result(output: ChoiceOutput = OUTPUT, reason: str = "stop", **kw) -> ChoiceResult:
    return ChoiceResult(output=output, finish_reason=reason, prompt_tokens=20, cached_tokens=16,
                        completion_tokens=9, **kw)  # fmt: skip


def sse_events(chunks: list[bytes]) -> list[tuple[str, dict]]:
    out = []
    for chunk in chunks:
        head, data = chunk.decode().removesuffix("\n\n").split("\n")
        assert head.startswith("event: ") and data.startswith("data: ")
        out.append((head[7:], json.loads(data[6:])))
    return out


def catch(fn, *args) -> APIError:
    with pytest.raises(APIError) as info:
        fn(*args)
    return info.value


# ------------------------------------------------------------------ Responses: requests


def _responses_plan(body: dict, monkeypatch) -> dict:
    """The chat body parse_responses builds (parse_chat is the chat branch's concern)."""
    seen = {}
    monkeypatch.setattr("app.api.chat_body.parse_chat",
                        lambda body, limits: seen.setdefault("body", body))  # fmt: skip
    parse_responses(body, LIMITS)
    return seen["body"]


def test_responses_input_items_become_chat_turns(monkeypatch) -> None:
    chat = _responses_plan({
        "model": "m", "instructions": "Be brief.", "max_output_tokens": 30, "temperature": 0.5,
        "input": [
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "reasoning", "id": "rs_1", "summary": [],
             "content": [{"type": "reasoning_text", "text": "Use the tool."}]},
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather",
             "arguments": '{"city": "Paris"}'},
            {"type": "function_call", "call_id": "c2", "name": "get_weather",
             "arguments": '{"city": "Lyon"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "function_call_output", "call_id": "c2",
             "output": [{"type": "input_text", "text": "rain"}]},
        ],
        "tools": [{"type": "function", "name": "get_weather", "description": "d",
                   "parameters": WEATHER, "strict": True}],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "text": {"format": {"type": "json_schema", "name": "w", "schema": WEATHER}},
        "reasoning": {"effort": "low", "summary": "auto"},
        "store": False, "metadata": {"k": "v"}, "include": ["reasoning.encrypted_content"],
    }, monkeypatch)  # fmt: skip
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Use the tool.",
         "tool_calls": [
             {"id": "c1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
             {"id": "c2", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
    ]  # fmt: skip
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "d", "parameters": WEATHER, "strict": True}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "w", "schema": WEATHER}}
    assert chat["reasoning_effort"] == "low"
    assert chat["max_completion_tokens"] == 30 and chat["temperature"] == 0.5
    assert chat["model"] == "m" and "store" not in chat and "metadata" not in chat


def test_responses_allowed_tools_narrow_the_tools(monkeypatch) -> None:
    tools = [{"type": "function", "name": n, "parameters": WEATHER} for n in ("a", "b", "c")]
    chat = _responses_plan({"input": "hi", "tools": tools, "tool_choice": {
        "type": "allowed_tools", "mode": "required",
        "tools": [{"type": "function", "name": "c"}]}}, monkeypatch)  # fmt: skip
    assert chat["tool_choice"] == "required"
    assert [t["function"]["name"] for t in chat["tools"]] == ["c"]


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id", "stateless"),
        ({"input": "hi", "conversation": "conv_1"}, "conversation", "stateless"),
        ({"input": "hi", "store": True}, "store", "stateless"),
        ({"input": "hi", "background": True}, "background", "stateless"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0]", "stateless"),
        ({"input": []}, "input", "non-empty"),
        ({}, "input", "string"),
        ({"input": "hi", "temprature": 1}, "temprature", "unknown"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", "'user'"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
         "input[0].content[0]", "text-only"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
         "input[0].call_id", "string"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1"}]},
         "input[0].arguments", "JSON object"),
        ({"input": [{"type": "web_search_call", "id": "x"}]}, "input[0].type", "function_call"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type", "'function'"),
        ({"input": "hi", "tool_choice": "any"}, "tool_choice", "'required'"),
        ({"input": "hi", "tool_choice": {"type": "allowed_tools", "mode": "auto",
                                         "tools": [{"type": "function", "name": "nope"}]}},
         "tool_choice.tools[0]", "nope"),
        ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format.type", "json_schema"),
        ({"input": "hi", "truncation": "auto"}, "truncation", "disabled"),
        ({"input": "hi", "include": ["message.output_text.logprobs"]}, "include", "allowed"),
        ({"input": "hi", "reasoning": {"effort": "low", "budget": 3}}, "reasoning.budget",
         "unknown"),
        ({"input": "hi", "stream_options": {}}, "stream_options", "stream: true"),
        ({"input": "hi", "reasoning": {"summary": "long"}}, "reasoning.summary", "'concise'"),
        ({"input": "hi", "tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name",
         "tools[0].name must be 1-64 letters"),
        ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": []}]},
         "tools[0].parameters", "JSON schema"),
    ],
)  # fmt: skip
def test_responses_bad_requests_name_their_field(body, param, words) -> None:
    exc = catch(parse_responses, body, LIMITS)
    assert exc.status == 400 and exc.param == param and words in exc.message, exc.message


def test_responses_chat_refusals_name_the_responses_field() -> None:
    exc = catch(parse_responses, {"input": "hi", "max_output_tokens": 0}, LIMITS)
    assert exc.param == "max_output_tokens" and "max_output_tokens must be" in exc.message
    exc = catch(parse_responses, {"input": ["x", {"role": "user", "content": "y"}]}, LIMITS)
    assert exc.param == "input[0]"
    exc = catch(parse_responses, {"input": "hi", "top_p": 0}, LIMITS)
    assert exc.param == "top_p"


# ------------------------------------------------------------------ Responses: replies


def _sdk_events(chunks: list[bytes]) -> list:
    from openai import omit
    from openai.lib.streaming.responses._responses import ResponseStreamState
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    adapter = TypeAdapter(ResponseStreamEvent)
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    events = []
    for name, obj in sse_events(chunks):
        assert name == obj["type"]
        event = adapter.validate_python(obj)
        state.handle_event(event)
        events.append(event)
    return events, state


def _call(**body) -> object:
    from app.api.openai_responses import ResponsesCall

    return ResponsesCall(plan=None, echo={  # type: ignore[arg-type]
        "instructions": None, "tools": body.get("tools", []), "tool_choice": "auto",
        "parallel_tool_calls": True, "temperature": None, "top_p": None,
        "max_output_tokens": None, "metadata": {}, "text": {"format": {"type": "text"}},
        "reasoning": None, "user": None})  # fmt: skip


def test_responses_stream_events_in_order_and_the_sdk_accumulates_them() -> None:
    enc = ResponsesEncoder(_call(), "m")
    chunks = enc.begin() + enc.events(EVENTS[:3]) + enc.events(EVENTS[3:]) + enc.end(result())
    events, state = _sdk_events(chunks)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    final = state._completed_response
    assert final.output_text == "Checking the weather."
    call = final.output[2]
    assert (call.type, call.call_id, call.name, call.arguments) == (
        "function_call", "call_abc", "get_weather", '{"city": "Paris"}')
    assert final.output[0].content[0].text == "Let me think."
    u = final.usage
    assert (u.input_tokens, u.input_tokens_details.cached_tokens, u.output_tokens,
            u.output_tokens_details.reasoning_tokens, u.total_tokens) == (20, 16, 9, 3, 29)


def test_responses_body_validates_and_a_cut_reply_is_incomplete() -> None:
    from openai.types.responses import Response

    enc = ResponsesEncoder(_call(), "m")
    body = Response.model_validate(enc.body(result()))
    assert [o.type for o in body.output] == ["reasoning", "message", "function_call"]
    assert body.status == "completed" and body.id.startswith("resp_")
    cut = Response.model_validate(enc.body(result(ChoiceOutput(content="abc"), "length")))
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.output_text == "abc"
    # streamed, the same cut ends with response.incomplete
    chunks = enc.begin() + enc.events([ContentDelta("abc")]) + enc.end(result(reason="length"))
    events, _ = _sdk_events(chunks)
    assert events[-1].type == "response.incomplete"


def test_responses_stream_error_after_the_start() -> None:
    enc = ResponsesEncoder(_call(), "m")
    chunks = enc.begin() + enc.events([ContentDelta("ab")]) + enc.failed(
        APIError(503, "the engine is not available", code="engine_unavailable"))
    events, _ = _sdk_events(chunks)
    assert events[-2].type == "error" and events[-2].code == "engine_unavailable"
    assert events[-1].type == "response.failed" and events[-1].response.status == "failed"


# ------------------------------------------------------------------ Messages: requests


def _messages_plan(body: dict, monkeypatch) -> dict:
    seen = {}
    monkeypatch.setattr("app.api.chat_body.parse_chat",
                        lambda body, limits: seen.setdefault("body", body))  # fmt: skip
    parse_messages(body, LIMITS)
    return seen["body"]


def test_messages_blocks_become_chat_turns(monkeypatch) -> None:
    chat = _messages_plan({
        "model": "m", "max_tokens": 40, "system": [{"type": "text", "text": "Be brief."}],
        "stop_sequences": ["END"], "top_k": 5, "temperature": 0.2,
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Use the tool.", "signature": ""},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                 "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1",
                 "content": [{"type": "text", "text": "sunny"}]},
                {"type": "text", "text": "Thanks!"}]},
        ],
        "tools": [{"name": "get_weather", "description": "d", "input_schema": WEATHER}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "thinking": {"type": "enabled", "budget_tokens": 10},
        "metadata": {"user_id": "u"},
    }, monkeypatch)  # fmt: skip
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Use the tool.",
         "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
             "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "user", "content": "Thanks!"},
    ]  # fmt: skip
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "parameters": WEATHER, "description": "d"}}]
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    assert chat["stop"] == ["END"] and chat["top_k"] == 5 and chat["max_tokens"] == 40
    assert chat["chat_template_kwargs"] == {"enable_thinking": True}
    named = _messages_plan({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
                            "tools": [{"name": "f", "input_schema": WEATHER}],
                            "tool_choice": {"type": "tool", "name": "f"}}, monkeypatch)  # fmt: skip
    assert named["tool_choice"] == {"type": "function", "function": {"name": "f"}}


USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"messages": USER}, "max_tokens", "required"),
        ({"max_tokens": 5}, "messages", "non-empty"),
        ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]},
         "messages[0].role", "'assistant'"),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "tool_use"}]}]},
         "messages[0].content[0].type", "user message"),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {}}]}]}, "messages[0].content[0]", "text-only"),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "tool_result", "content": "x"}]}]},
         "messages[0].content[0].tool_use_id", "string"),
        ({"max_tokens": 5, "messages": [{"role": "assistant", "content": [
            {"type": "tool_use", "id": "t", "name": "f", "input": [1]}]}]},
         "messages[0].content[0].input", "object"),
        ({"max_tokens": 5, "messages": USER, "tools": [{"name": "f"}]},
         "tools[0].input_schema", "required"),
        ({"max_tokens": 5, "messages": USER, "tools": [{"type": "web_search_20250305",
                                                        "name": "web_search"}]},
         "tools[0].type", "server tools"),
        ({"max_tokens": 5, "messages": USER, "tool_choice": {"type": "required"}},
         "tool_choice.type", "'any'"),
        ({"max_tokens": 5, "messages": USER, "thinking": {"type": "enabled"}},
         "thinking.budget_tokens", "integer"),
        ({"max_tokens": 5, "messages": USER, "temperature": 1.5}, "temperature", "[0, 1]"),
        ({"max_tokens": 5, "messages": USER, "mcp_servers": [{"url": "x"}]}, "mcp_servers",
         "not supported"),
        ({"max_tokens": 5, "messages": USER, "stop_sequence": ["x"]}, "stop_sequence",
         "unknown"),
        ({"max_tokens": 5, "messages": USER, "system": 3}, "system", "string"),
        ({"max_tokens": 5, "messages": USER, "tools": [{"input_schema": WEATHER}]},
         "tools[0].name", "tools[0].name must be"),
        ({"max_tokens": 5, "messages": USER, "tools": [{"name": "f",
                                                        "input_schema": {"type": "array"}}]},
         "tools[0].input_schema", "tools[0].input_schema must be a JSON schema"),
    ],
)  # fmt: skip
def test_messages_bad_requests_name_their_field(body, param, words) -> None:
    exc = catch(parse_messages, body, LIMITS)
    assert exc.status == 400 and exc.param == param and words in exc.message, exc.message


def test_messages_chat_refusals_name_the_messages_field() -> None:
    exc = catch(parse_messages, {"max_tokens": 0, "messages": USER}, LIMITS)
    assert exc.param == "max_tokens"
    exc = catch(parse_messages, {"max_tokens": 5, "messages": USER, "stop_sequences": [""]},
                LIMITS)  # fmt: skip
    assert exc.param == "stop_sequences" and exc.message.startswith("stop_sequences must")


# ------------------------------------------------------------------ Messages: replies


def _anthropic_events(chunks: list[bytes]) -> list:
    from anthropic.lib.streaming._messages import accumulate_event
    from anthropic.types import RawMessageStreamEvent
    from pydantic import TypeAdapter

    adapter = TypeAdapter(RawMessageStreamEvent)
    snapshot, bufs, events = None, {}, []
    for name, obj in sse_events(chunks):
        assert name == obj["type"]
        event = adapter.validate_python(obj)
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=bufs)
        events.append(event)
    return events, snapshot


def test_messages_stream_events_in_order_and_the_sdk_accumulates_them() -> None:
    enc = MessagesEncoder("m")
    chunks = enc.begin() + enc.events(EVENTS) + enc.end(result())
    events, message = _anthropic_events(chunks)
    kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in events]
    assert kinds == [
        ("message_start", None),
        ("content_block_start", None), ("content_block_delta", "thinking_delta"),
        ("content_block_delta", "thinking_delta"), ("content_block_stop", None),
        ("content_block_start", None), ("content_block_delta", "text_delta"),
        ("content_block_delta", "text_delta"), ("content_block_stop", None),
        ("content_block_start", None), ("content_block_delta", "input_json_delta"),
        ("content_block_delta", "input_json_delta"), ("content_block_stop", None),
        ("message_delta", None), ("message_stop", None),
    ]  # fmt: skip
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
    assert message.content[0].thinking == "Let me think."
    assert message.content[1].text == "Checking the weather."
    assert message.content[2].input == {"city": "Paris"}
    assert message.content[2].id == "toolu_abc"
    assert message.stop_reason == "tool_use"
    u = message.usage
    assert (u.input_tokens, u.cache_read_input_tokens, u.output_tokens) == (4, 16, 9)


def test_messages_body_validates_with_each_stop_reason() -> None:
    from anthropic.types import Message

    enc = MessagesEncoder("m")
    whole = Message.model_validate(enc.body(result()))
    assert [b.type for b in whole.content] == ["thinking", "text", "tool_use"]
    assert whole.stop_reason == "tool_use" and whole.id.startswith("msg_")
    text = ChoiceOutput(content="hi")
    assert Message.model_validate(enc.body(result(text))).stop_reason == "end_turn"
    assert Message.model_validate(enc.body(result(text, "length"))).stop_reason == "max_tokens"
    stopped = Message.model_validate(enc.body(result(text, stop_sequence="END")))
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "END")
    empty = Message.model_validate(enc.body(result(ChoiceOutput(content=""))))
    assert [b.type for b in empty.content] == ["text"]


def test_messages_stream_error_is_an_error_event() -> None:
    enc = MessagesEncoder("m")
    [(name, obj)] = sse_events(enc.failed(APIError(503, "engine gone")))
    assert name == "error"
    assert obj == {"type": "error", "error": {"type": "overloaded_error", "message": "engine gone"}}


# ------------------------------------------------------------------ the driver


class PlainReader:
    """A stand-in for chat_output.ChoiceReader (the tools branch's): all text is content."""

    def __init__(self) -> None:
        self.text: list[str] = []

    def feed(self, text: str, num_tokens: int = 0) -> list:
        self.text.append(text)
        return [ContentDelta(text)]

    def finish(self) -> list:
        return []

    def output(self) -> ChoiceOutput:
        return ChoiceOutput(content="".join(self.text))


def test_a_choice_run_reads_deltas_and_takes_the_counts_from_the_finish() -> None:
    run = ChoiceRun(PlainReader())
    delta = P.Delta(request_id="r", index=0, token_ids=[1, 2], text="ab", token_times=[0, 0],
                    time=0.0)  # fmt: skip
    assert run.add(delta) == [ContentDelta("ab")]
    usage = P.Usage(prompt_tokens=7, cached_tokens=4, completion_tokens=2)
    run.add(P.Finish(request_id="r", index=0, reason="length", usage=usage))
    got = run.result()
    assert (got.output.content, got.finish_reason, got.prompt_tokens, got.cached_tokens,
            got.completion_tokens) == ("ab", "length", 7, 4, 2)  # fmt: skip


# ------------------------------------------------------------------ with the chat core's reader


def _read(plan, pieces: list[str], reason: str = "stop") -> tuple[list, ChoiceResult]:
    """The engine's text of one choice, read by chat_output.ChoiceReader as the server does."""
    from app.api.agent_runs import default_reader

    run = ChoiceRun(default_reader(plan))
    events = []
    for piece in pieces:
        events += run.add(P.Delta(request_id="r", index=0, token_ids=[0], text=piece,
                                  token_times=[0.0], time=0.0))  # fmt: skip
    usage = P.Usage(prompt_tokens=10, cached_tokens=0, completion_tokens=len(pieces))
    events += run.add(P.Finish(request_id="r", index=0, reason=reason, usage=usage))
    return events, run.result()


THINK_AND_CALL = ["<think>", "Use the", " tool.</think>", "Let me check.", "<tool_call>",
                  '{"name": "get_weather", ', '"arguments": {"city": "Paris"}}', "</tool_call>"]


def test_a_thinking_reply_with_a_call_through_both_apis() -> None:
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    r_plan = parse_responses({"input": "Weather?", "tools": tools, "stream": True}, LIMITS).plan
    m_plan = parse_messages({"max_tokens": 50, "messages": USER, "stream": True,
                             "tools": [{"name": "get_weather", "input_schema": WEATHER}],
                             "thinking": {"type": "enabled", "budget_tokens": 10}},
                            LIMITS).plan  # fmt: skip
    for plan in (r_plan, m_plan):  # as apply_model sets them for a model that thinks
        plan.tool_parser, plan.reasoning = "hermes", True
    assert m_plan.chat_template_kwargs == {"enable_thinking": True}

    events, res = _read(r_plan, THINK_AND_CALL)
    enc = ResponsesEncoder(_call(), "m")
    streamed, state = _sdk_events(enc.begin() + enc.events(events) + enc.end(res))
    final = state._completed_response
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]
    assert final.output[0].content[0].text == "Use the tool."
    assert final.output_text == "Let me check."
    assert json.loads(final.output[2].arguments) == {"city": "Paris"}
    whole = enc.body(res)
    assert [o["type"] for o in whole["output"]] == ["reasoning", "message", "function_call"]

    events, res = _read(m_plan, THINK_AND_CALL)
    enc = MessagesEncoder("m")
    _, message = _anthropic_events(enc.begin() + enc.events(events) + enc.end(res))
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
    assert message.content[2].input == {"city": "Paris"} and message.stop_reason == "tool_use"
    assert enc.body(res)["content"][2]["input"] == {"city": "Paris"}


@pytest.mark.parametrize(("thinking", "is_open"), [({"type": "enabled", "budget_tokens": 8}, True),
                                                   ({"type": "disabled"}, False), (None, True)])
def test_anthropic_thinking_reaches_the_template_and_the_reader(thinking, is_open) -> None:
    """Under a template whose generation prompt opens <think> (ModelInfo.reasoning_parser
    "think_open"), thinking off makes the template close it and the reader start outside."""
    from types import SimpleNamespace

    from app.api.tools.request import apply_model

    body = {"max_tokens": 20, "messages": USER, **({"thinking": thinking} if thinking else {})}
    plan = parse_messages(body, LIMITS).plan
    apply_model(plan, SimpleNamespace(tool_parser="", reasoning_parser="think_open"), None)
    assert plan.reasoning and plan.reasoning_open is is_open
    events, res = _read(plan, ["Hmm.", "</think>", "Yes."] if is_open else ["Yes."])
    assert (res.output.reasoning, res.output.content) == (("Hmm.", "Yes.") if is_open
                                                          else (None, "Yes."))  # fmt: skip
    _, message = _anthropic_events((enc := MessagesEncoder("m")).begin() + enc.events(events)
                                   + enc.end(res))  # fmt: skip
    kinds = [b.type for b in message.content]
    assert kinds == (["thinking", "text"] if is_open else ["text"])


def test_a_bug_mid_stream_still_ends_the_stream_in_the_apis_shape() -> None:
    import asyncio

    from app.api.agent_runs import stream

    class Broken:
        def feed(self, text: str, num_tokens: int = 0) -> list:
            raise RuntimeError("reader bug")

    class OneDelta:  # a Generation whose engine sends one delta
        origin_id = "x"

        async def events(self):
            yield 0, P.Delta(request_id="r", index=0, token_ids=[1], text="a", token_times=[0.0],
                             time=0.0)  # fmt: skip

    async def run() -> list[bytes]:
        return [c async for c in stream(OneDelta(), ChoiceRun(Broken()), MessagesEncoder("m"),
                                        [])]  # fmt: skip

    events = sse_events(asyncio.run(run()))
    assert [name for name, _ in events] == ["message_start", "error"]
    assert events[-1][1]["error"] == {"type": "api_error",
                                      "message": "internal server error: reader bug"}
