"""/v1/responses and /v1/messages against the session's real `serve` process, driven by the
official `openai` and `anthropic` SDKs (and the OpenAI Agents SDK for tool round trips).

The reference for every reply is /v1/chat/completions on the same conversation: both APIs are
translations over the chat core, so greedy text and token counts must equal chat's. Forced tool
calls need the engine to enforce their JSON schema (the structured output branch,
app/api/structured.py): those round trips skip until it is merged.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import threading
from typing import Literal

import anthropic
import httpx
import openai
import pytest

from tests.app.api.helpers import API_KEY, MODEL

pytestmark = pytest.mark.slow

AUTH = {"authorization": f"Bearer {API_KEY}"}
PROMPT = "Tell me about paged attention."
SYSTEM = "You are brief."
CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
        "required": ["city"], "additionalProperties": False}  # fmt: skip
# the anthropic SDK (2.x) dropped temperature from messages.create; the API still takes it
GREEDY = {"temperature": 0}
STRUCTURED = importlib.util.find_spec("app.api.structured") is not None
needs_structured = pytest.mark.skipif(
    not STRUCTURED, reason="forced tool calls need structured output (app/api/structured.py)"
)


@pytest.fixture()
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)


def chat_reference(sdk, max_tokens: int, system: str | None = None, **extra):
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": PROMPT}]  # fmt: skip
    return sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                       temperature=0, **extra)  # fmt: skip


# ------------------------------------------------------------------ Responses


def test_responses_create_equals_chat_and_streaming_reassembles_it(sdk) -> None:
    want = chat_reference(sdk, 8, SYSTEM)
    got = sdk.responses.create(model=MODEL, instructions=SYSTEM, input=PROMPT,
                               max_output_tokens=8, temperature=0)  # fmt: skip
    assert got.id.startswith("resp_") and got.object == "response"
    assert got.output_text == want.choices[0].message.content
    assert got.status == ("incomplete" if want.choices[0].finish_reason == "length"
                          else "completed")  # fmt: skip
    assert got.usage.input_tokens == want.usage.prompt_tokens
    assert got.usage.output_tokens == want.usage.completion_tokens
    assert got.usage.input_tokens_details.cached_tokens > 0  # the same prompt, just now
    events = list(sdk.responses.create(model=MODEL, instructions=SYSTEM, input=PROMPT,
                                       max_output_tokens=8, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == f"response.{got.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == got.output_text == events[-1].response.output_text
    counted = sdk.responses.input_tokens.count(model=MODEL, instructions=SYSTEM, input=PROMPT)
    assert counted.input_tokens == want.usage.prompt_tokens
    # nothing is stored: retrieving the response is a 404 that says so
    with pytest.raises(openai.NotFoundError, match="stateless"):
        sdk.responses.retrieve(got.id)


def test_responses_items_and_a_tool_result_turn_are_accepted(sdk) -> None:
    tools = [{"type": "function", "name": "get_weather", "parameters": CITY, "strict": True}]
    got = sdk.responses.create(model=MODEL, max_output_tokens=6, temperature=0, tools=tools,
                               input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C, sunny"},
    ])  # fmt: skip
    assert got.status in ("completed", "incomplete") and got.usage.output_tokens > 0
    assert got.tools[0].name == "get_weather"


def test_async_responses_stream_manager_sees_every_event(async_sdk) -> None:
    # the tiny model stopping by itself within a few tokens is not guaranteed: the last event
    # is response.completed or response.incomplete, both carrying the final response
    async def run() -> list:
        async with async_sdk.responses.stream(model=MODEL, input=PROMPT, max_output_tokens=6,
                                              temperature=0) as stream:  # fmt: skip
            return [e async for e in stream]

    events = asyncio.run(asyncio.wait_for(run(), 120))
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == last.response.output_text


# ------------------------------------------------------------------ Messages


def test_messages_create_equals_chat_and_stream_reassembles_it(sdk, claude) -> None:
    want = chat_reference(sdk, 8, SYSTEM)
    got = claude.messages.create(model=MODEL, max_tokens=8, system=SYSTEM, extra_body=GREEDY,
                                 messages=[{"role": "user", "content": PROMPT}])  # fmt: skip
    assert got.id.startswith("msg_") and got.role == "assistant"
    assert got.content[0].type == "text"
    assert got.content[0].text == want.choices[0].message.content
    assert got.stop_reason == ("max_tokens" if want.choices[0].finish_reason == "length"
                               else "end_turn")  # fmt: skip
    u = got.usage
    assert u.input_tokens + u.cache_read_input_tokens == want.usage.prompt_tokens
    assert u.cache_read_input_tokens > 0 and u.output_tokens == want.usage.completion_tokens
    with claude.messages.stream(model=MODEL, max_tokens=8, system=SYSTEM, extra_body=GREEDY,
                                messages=[{"role": "user", "content": PROMPT}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == got.content[0].text
    assert final.stop_reason == got.stop_reason
    assert final.usage.output_tokens == u.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        want.usage.prompt_tokens  # fmt: skip
    counted = claude.messages.count_tokens(model=MODEL, system=SYSTEM,
                                           messages=[{"role": "user", "content": PROMPT}])
    assert counted.input_tokens == want.usage.prompt_tokens


def test_messages_stop_sequence_is_named(sdk, claude) -> None:
    text = chat_reference(sdk, 16).choices[0].message.content
    words = [w for w in text.split() if len(w) >= 2]
    assert words, text
    stop = words[len(words) // 2][:2]
    got = claude.messages.create(model=MODEL, max_tokens=16, extra_body=GREEDY,
                                 stop_sequences=[stop],
                                 messages=[{"role": "user", "content": PROMPT}])  # fmt: skip
    assert (got.stop_reason, got.stop_sequence) == ("stop_sequence", stop)
    assert got.content[0].text == text[: text.find(stop)]


def test_a_client_leaving_mid_stream_aborts_its_request(server) -> None:
    """Both APIs' streams end their engine request when the client goes (its KV blocks are
    freed): the engine counts an abort per stream and returns to idle."""
    from tests.app.api.test_server import _idle, _wait_metrics

    aborts = 'kvscope:request_success_total{finished_reason=abort}'
    before = _wait_metrics(server, _idle)[aborts]
    bodies = [("/v1/responses", {"input": PROMPT, "max_output_tokens": 400, "stream": True}),
              ("/v1/messages", {"max_tokens": 400, "stream": True,
                                "messages": [{"role": "user", "content": PROMPT}]})]  # fmt: skip
    for path, body in bodies:
        with httpx.stream("POST", server.url + path, json=body, headers=AUTH, timeout=60) as r:
            lines = r.iter_lines()
            while "delta" not in next(lines):  # leave once the first token arrived
                pass
    m = _wait_metrics(server, lambda m: _idle(m) and m[aborts] == before + 2)
    assert _idle(m) and m[aborts] == before + 2


# ------------------------------------------------------------------ bad input


ANTHROPIC_USER = [{"role": "user", "content": "hi"}]
BAD = [
    ("/v1/responses", {"model": MODEL, "input": "hi", "previous_response_id": "resp_1"},
     "previous_response_id"),
    ("/v1/responses", {"model": MODEL, "input": "hi", "store": True}, "store"),
    ("/v1/responses", {"model": MODEL, "input": "hi", "background": True}, "background"),
    ("/v1/responses", {"model": MODEL, "input": [{"type": "message", "role": "user",
                                                  "content": [{"type": "input_image"}]}]},
     "input[0].content[0]"),
    ("/v1/responses", {"model": MODEL, "input": "hi", "tools": [
        {"type": "function", "name": "f", "parameters": CITY}],
        "tool_choice": {"type": "function", "name": "g"}}, "tool_choice"),
    ("/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": -1},
     "max_output_tokens"),
    ("/v1/messages", {"model": MODEL, "messages": ANTHROPIC_USER}, "max_tokens"),
    ("/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "video"}]}]}, "messages[0].content[0].type"),
    ("/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": ANTHROPIC_USER,
                      "tools": [{"name": "f", "input_schema": CITY}],
                      "tool_choice": {"type": "tool", "name": "g"}}, "tool_choice"),
    ("/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": ANTHROPIC_USER,
                      "tools": [{"description": "no name", "input_schema": CITY}]}, "tools[0]"),
]  # fmt: skip


def test_bad_requests_are_400_in_each_apis_shape_while_the_server_serves_others(
    server, sdk
) -> None:
    done: list[str] = []

    def busy() -> None:  # a long stream in flight the whole time
        stream = sdk.chat.completions.create(model=MODEL, max_tokens=48, temperature=0,
                                             messages=[{"role": "user", "content": PROMPT}],
                                             stream=True)  # fmt: skip
        done.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))

    other = threading.Thread(target=busy)
    other.start()
    for path, body, field in BAD:
        r = httpx.post(server.url + path, json=body, headers=AUTH, timeout=60)
        assert r.status_code == 400, (path, body, r.text)
        got = r.json()
        if path == "/v1/messages":
            assert got["type"] == "error" and got["error"]["type"] == "invalid_request_error"
            assert field in got["error"]["message"], got
        else:
            assert got["error"]["type"] == "invalid_request_error"
            assert got["error"]["param"].startswith(field), got
    # a wrong key on /v1/messages is Anthropic's authentication_error; x-api-key is a key
    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": "wrong"}, timeout=60,
                   json={"max_tokens": 2, "messages": ANTHROPIC_USER})  # fmt: skip
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": API_KEY}, timeout=60,
                   json={"max_tokens": 2, "messages": ANTHROPIC_USER})  # fmt: skip
    assert r.status_code == 200 and r.json()["type"] == "message"
    other.join(120)
    assert done and done[0]


# ------------------------------------------------------------------ tool round trips


def get_weather_impl(city: str) -> str:
    return f"18 C and sunny in {city}"


@needs_structured
@pytest.mark.parametrize("kind", ["responses", "chat_completions"])
def test_openai_agents_sdk_tool_round_trip(server, kind) -> None:
    import agents as A
    from openai import AsyncOpenAI

    A.set_tracing_disabled(True)
    calls: list[str] = []

    # an enum, not a free string: a random model writes a free string until max_tokens
    @A.function_tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return get_weather_impl(city)

    client = AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    model = (A.OpenAIResponsesModel if kind == "responses" else A.OpenAIChatCompletionsModel)(
        model=MODEL, openai_client=client)  # fmt: skip
    # The random model never ends a free reply by itself, and the Agents SDK fails a Responses
    # reply cut by max_output_tokens (status "incomplete") where it takes a chat reply cut by
    # max_tokens as the answer: through Responses the agent ends with the tool's result, and the
    # result's trip back to the model is test_responses_forced_call_and_its_result's.
    behaviour = "stop_on_first_tool" if kind == "responses" else "run_llm_again"
    agent = A.Agent(name="weather", instructions="Use the tool.", tools=[get_weather],
                    model=model, tool_use_behavior=behaviour,
                    model_settings=A.ModelSettings(tool_choice="required", max_tokens=96,
                                                   temperature=0, parallel_tool_calls=False))
    # (parallel calls are an unbounded JSON array: a random model fills it to max_tokens)
    result = asyncio.run(A.Runner.run(agent, "Weather in Paris?", max_turns=3,
                                      run_config=A.RunConfig(tracing_disabled=True)))  # fmt: skip
    assert calls and calls[0] in ("Paris", "Oslo")  # the forced call ran with valid arguments
    if kind == "responses":
        assert result.final_output == get_weather_impl(calls[0])
    else:  # the tool's result went back to the model, which answered
        assert isinstance(result.final_output, str) and len(result.raw_responses) == 2


@needs_structured
def test_responses_forced_call_and_its_result(sdk) -> None:
    tools = [{"type": "function", "name": "get_weather", "parameters": CITY, "strict": True}]
    first = sdk.responses.create(model=MODEL, input="Weather?", tools=tools, temperature=1.0,
                                 tool_choice="required", max_output_tokens=256,
                                 parallel_tool_calls=False)  # fmt: skip
    [call] = [o for o in first.output if o.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Oslo")
    events = list(sdk.responses.create(model=MODEL, input="Weather?", tools=tools, stream=True,
                                       tool_choice={"type": "function", "name": "get_weather"},
                                       max_output_tokens=256, parallel_tool_calls=False))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(args)["city"] in ("Paris", "Oslo")
    follow = sdk.responses.create(model=MODEL, tools=tools, max_output_tokens=6, input=[
        {"role": "user", "content": "Weather?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id,
         "output": get_weather_impl("Paris")}])  # fmt: skip
    assert follow.status in ("completed", "incomplete")


@needs_structured
@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_sdk_tool_round_trip(claude, stream) -> None:
    tools = [{"name": "get_weather", "description": "The weather in a city.",
              "input_schema": CITY}]  # fmt: skip
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    args = {"model": MODEL, "max_tokens": 256, "tools": tools, "messages": messages,
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}  # fmt: skip
    if stream:
        with claude.messages.stream(**args) as s:
            first = s.get_final_message()
    else:
        first = claude.messages.create(**args)
    assert first.stop_reason == "tool_use"
    [use] = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input["city"] in ("Paris", "Oslo")
    result = {"type": "tool_result", "tool_use_id": use.id,
              "content": get_weather_impl(use.input["city"])}  # fmt: skip
    follow = claude.messages.create(model=MODEL, max_tokens=6, tools=tools, messages=messages + [
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": [result]}])  # fmt: skip
    assert follow.stop_reason in ("end_turn", "max_tokens", "tool_use")


@needs_structured
def test_structured_output_through_both_apis(sdk, claude) -> None:
    from pydantic import BaseModel, ConfigDict

    class Weather(BaseModel):
        model_config = ConfigDict(extra="forbid")
        city: Literal["Paris", "Oslo"]
        sunny: bool

    got = sdk.responses.parse(model=MODEL, input="Weather?", text_format=Weather,
                              max_output_tokens=128, temperature=1.0)  # fmt: skip
    assert isinstance(got.output_parsed, Weather)
    # (json_object is left out: a random model writes a free string until max_tokens)
    schema = Weather.model_json_schema()
    events = list(sdk.responses.create(model=MODEL, input="Weather?", max_output_tokens=128,
                                       stream=True, text={"format": {
                                           "type": "json_schema", "name": "weather",
                                           "schema": schema, "strict": True}}))  # fmt: skip
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert Weather.model_validate_json(text) and events[-1].type == "response.completed"
    reply = claude.messages.create(model=MODEL, max_tokens=128,
                                   messages=[{"role": "user", "content": "Weather?"}],
                                   output_config={"format": {"type": "json_schema",
                                                             "schema": schema}})  # fmt: skip
    Weather.model_validate_json(reply.content[0].text)
