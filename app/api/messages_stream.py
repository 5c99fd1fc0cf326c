"""The Messages API's replies: the whole message, and its stream events.

The stream, as Anthropic sends it (each event `event: <type>` + `data: <json>`):

    message_start                      the message with empty content and stop_reason null
    per content block, in the order the model writes them (thinking, text, tool_use):
      content_block_start, content_block_delta... (thinking_delta | text_delta |
      input_json_delta), content_block_stop
    message_delta                      stop_reason, stop_sequence and the usage
    message_stop

The prompt's token count is known when the engine finishes the request, so message_start
carries input_tokens 0 and message_delta the real input, cache-read and output counts (the
SDK's accumulator takes them from there). An error after the 200: an `error` event in
Anthropic's shape, and the stream ends.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import msgspec

from app.api.agent_runs import ChoiceResult
from app.api.anthropic_messages import error_body
from app.api.chat_output import (
    ChoiceEvent,
    ChoiceOutput,
    ContentDelta,
    ReasoningDelta,
    ToolCallArguments,
    ToolCallStart,
)
from app.api.errors import APIError

STOP_REASONS = {"length": "max_tokens"}  # the engine's finish reasons in Anthropic's words


# ------------------------------------------------------------------ the whole reply


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def tool_use_id(call_id: str) -> str:
    """Chat's call ids ("call_…") in Anthropic's spelling ("toolu_…"); any id round-trips."""
    return "toolu_" + call_id.removeprefix("call_")


def tool_input(arguments: str) -> dict[str, Any]:
    try:
        parsed = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        parsed = None
    # the reader hands over whole calls only; a non-object is a bug worth seeing, not hiding
    if not isinstance(parsed, dict):
        raise APIError(500, f"the model's tool call arguments are not a JSON object: "
                       f"{arguments[:200]!r}", code="bad_tool_call")  # fmt: skip
    return parsed


def stop_reason(result: ChoiceResult) -> str:
    if result.output.tool_calls:
        return "tool_use"
    if result.stop_sequence is not None:
        return "stop_sequence"
    return STOP_REASONS.get(result.finish_reason, "end_turn")


def usage_of(result: ChoiceResult) -> dict[str, Any]:
    """Anthropic counts cache reads apart: input_tokens are the prompt tokens computed anew."""
    return {
        "input_tokens": result.prompt_tokens - result.cached_tokens,
        "output_tokens": result.completion_tokens,
        "cache_read_input_tokens": result.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def content_blocks(output: ChoiceOutput) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if output.reasoning:  # as streamed: an empty thinking block makes no item
        blocks.append({"type": "thinking", "thinking": output.reasoning, "signature": ""})
    if output.content or not output.tool_calls:
        blocks.append({"type": "text", "text": output.content})
    for call in output.tool_calls:
        blocks.append({"type": "tool_use", "id": tool_use_id(call.id), "name": call.name,
                       "input": tool_input(call.arguments)})  # fmt: skip
    return blocks


def message_object(
    message_id: str, model: str, content: list[dict[str, Any]], stop: str | None,
    stop_sequence: str | None, usage: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    return {"id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": stop, "stop_sequence": stop_sequence,
            "usage": usage}  # fmt: skip


def whole_message(message_id: str, model: str, result: ChoiceResult) -> dict[str, Any]:
    return message_object(message_id, model, content_blocks(result.output), stop_reason(result),
                          result.stop_sequence, usage_of(result))  # fmt: skip


# ------------------------------------------------------------------ the stream


def event_bytes(kind: str, obj: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode(obj) + b"\n\n"


class MessagesEncoder:
    """One message: the APIEncoder of agent_runs.py for /v1/messages."""

    def __init__(self, model: str, message_id: str | None = None) -> None:
        self.model = model
        self.id = message_id or new_id("msg")
        self.blocks = 0  # content blocks started
        self.open: str | None = None  # the open block's kind
        self.calls: dict[int, int] = {}  # ToolCallStart.index -> its block index

    def body(self, result: ChoiceResult) -> dict[str, Any]:
        return whole_message(self.id, self.model, result)

    def begin(self) -> list[bytes]:
        start = message_object(self.id, self.model, [], None, None,
                               {"input_tokens": 0, "output_tokens": 0})  # fmt: skip
        return [self._event("message_start", message=start)]

    def events(self, events: list[ChoiceEvent]) -> list[bytes]:
        out: list[bytes] = []
        for ev in events:
            if isinstance(ev, ContentDelta | ReasoningDelta):
                if not ev.text:
                    continue
                if isinstance(ev, ContentDelta):
                    kind, block, delta = "text", {"type": "text", "text": ""}, \
                        {"type": "text_delta", "text": ev.text}  # fmt: skip
                else:
                    kind, block, delta = "thinking", \
                        {"type": "thinking", "thinking": "", "signature": ""}, \
                        {"type": "thinking_delta", "thinking": ev.text}  # fmt: skip
                if self.open != kind:
                    self._start(out, kind, block)
                out.append(self._event("content_block_delta", index=self.blocks - 1, delta=delta))
            elif isinstance(ev, ToolCallStart):
                self._start(out, "tool_use", {"type": "tool_use", "id": tool_use_id(ev.id),
                                              "name": ev.name, "input": {}})  # fmt: skip
                self.calls[ev.index] = self.blocks - 1
            elif isinstance(ev, ToolCallArguments) and ev.text:
                out.append(self._event("content_block_delta", index=self.calls[ev.index],
                                       delta={"type": "input_json_delta",
                                              "partial_json": ev.text}))  # fmt: skip
        return out

    def end(self, result: ChoiceResult) -> list[bytes]:
        out: list[bytes] = []
        if self.blocks == 0:  # an empty reply is one empty text block, as in the body
            self._start(out, "text", {"type": "text", "text": ""})
        self._stop(out)
        out.append(self._event("message_delta",
                               delta={"stop_reason": stop_reason(result),
                                      "stop_sequence": result.stop_sequence},
                               usage=usage_of(result)))  # fmt: skip
        out.append(self._event("message_stop"))
        return out

    def failed(self, exc: APIError) -> list[bytes]:
        body = error_body(exc)
        return [event_bytes("error", body)]

    def _start(self, out: list[bytes], kind: str, block: dict[str, Any]) -> None:
        self._stop(out)
        out.append(self._event("content_block_start", index=self.blocks, content_block=block))
        self.blocks += 1
        self.open = kind

    def _stop(self, out: list[bytes]) -> None:
        if self.open is not None:
            out.append(self._event("content_block_stop", index=self.blocks - 1))
            self.open = None

    @staticmethod
    def _event(kind: str, **fields: Any) -> bytes:
        return event_bytes(kind, {"type": kind, **fields})
