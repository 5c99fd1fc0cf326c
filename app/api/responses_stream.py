"""The Responses API's replies: the whole Response, and its typed stream events.

The stream, as OpenAI sends it (each event `event: <type>` + `data: <json>` with a growing
`sequence_number`):

    response.created, response.in_progress
    per output item, in the order the model writes them:
      response.output_item.added
      reasoning: content_part.added, reasoning_text.delta..., reasoning_text.done, content_part.done
      message:   content_part.added, output_text.delta..., output_text.done, content_part.done
      function call: function_call_arguments.delta..., function_call_arguments.done
      response.output_item.done
    response.completed (response.incomplete when max_output_tokens cut it short)

An error after the 200 went out: an `error` event, then response.failed.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec

from app.api.agent_runs import ChoiceResult
from app.api.chat_output import (
    ChoiceEvent,
    ChoiceOutput,
    ContentDelta,
    ReasoningDelta,
    ToolCallArguments,
    ToolCallStart,
)
from app.api.errors import APIError
from app.api.openai_responses import ResponsesCall

# ------------------------------------------------------------------ the whole reply


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage_of(result: ChoiceResult) -> dict[str, Any]:
    return {
        "input_tokens": result.prompt_tokens,
        # the prefix cache writes no separately billed tokens: cache_write_tokens is always 0
        "input_tokens_details": {"cached_tokens": result.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": result.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": result.output.reasoning_tokens},
        "total_tokens": result.prompt_tokens + result.completion_tokens,
    }


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}  # fmt: skip


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [text_part(text)]}  # fmt: skip


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}  # fmt: skip


def output_items(output: ChoiceOutput, incomplete: bool) -> list[dict[str, Any]]:
    """A finished choice's output items: its reasoning, its text, its calls (in that order)."""
    items = []
    status = "incomplete" if incomplete else "completed"
    if output.reasoning:  # as streamed: an empty thinking block makes no item
        items.append(reasoning_item(new_id("rs"), output.reasoning, "completed"))
    if output.content or not output.tool_calls:
        items.append(message_item(new_id("msg"), output.content, status))
    for call in output.tool_calls:
        items.append(call_item(new_id("fc"), call.id, call.name, call.arguments, "completed"))
    return items


def response_object(
    call: ResponsesCall,
    response_id: str,
    model: str,
    created: int,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "background": False,
        "error": error,
        "incomplete_details": incomplete,
        "model": model,
        "output": output,
        "previous_response_id": None,
        "store": False,
        "truncation": "disabled",
        "usage": usage,
        **call.echo,
        **({"completed_at": int(time.time())} if status == "completed" else {}),
    }


def whole_response(
    call: ResponsesCall, response_id: str, model: str, created: int, result: ChoiceResult
) -> dict[str, Any]:
    incomplete = result.finish_reason == "length"
    return response_object(call, response_id, model, created,
                           "incomplete" if incomplete else "completed",
                           output_items(result.output, incomplete), usage_of(result))  # fmt: skip


# ------------------------------------------------------------------ the stream


def event_bytes(kind: str, obj: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode(obj) + b"\n\n"


@dataclass(slots=True)
class _Item:
    """One output item being streamed."""

    kind: str  # "reasoning" | "message" | "function_call"
    id: str
    index: int  # output_index
    text: list[str] = field(default_factory=list)  # text, reasoning or arguments so far
    call_id: str = ""
    name: str = ""

    def item(self, status: str) -> dict[str, Any]:
        text = "".join(self.text)
        if self.kind == "reasoning":
            return reasoning_item(self.id, text, status)
        if self.kind == "message":
            return message_item(self.id, text, status)
        return call_item(self.id, self.call_id, self.name, text, status)


class ResponsesEncoder:
    """One Response: the APIEncoder of agent_runs.py for /v1/responses."""

    def __init__(self, call: ResponsesCall, model: str, response_id: str | None = None) -> None:
        self.call = call
        self.model = model
        self.id = response_id or new_id("resp")
        self.created = int(time.time())
        self.seq = 0
        self.items: list[_Item] = []
        self.open: _Item | None = None
        self.calls: dict[int, _Item] = {}  # ToolCallStart.index -> its item

    # -------------------------------------------------------------- APIEncoder

    def body(self, result: ChoiceResult) -> dict[str, Any]:
        return whole_response(self.call, self.id, self.model, self.created, result)

    def begin(self) -> list[bytes]:
        snapshot = self._response("in_progress", [], None)
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]  # fmt: skip

    def events(self, events: list[ChoiceEvent]) -> list[bytes]:
        out: list[bytes] = []
        for ev in events:
            if isinstance(ev, ContentDelta | ReasoningDelta):
                if not ev.text:
                    continue
                kind = "message" if isinstance(ev, ContentDelta) else "reasoning"
                item = self.open if self.open is not None and self.open.kind == kind else None
                if item is None:
                    item = self._start(out, kind, new_id("msg" if kind == "message" else "rs"))
                item.text.append(ev.text)
                delta = "response.output_text.delta" if kind == "message" else \
                    "response.reasoning_text.delta"  # fmt: skip
                extra = {"logprobs": []} if kind == "message" else {}
                out.append(self._event(delta, item_id=item.id, output_index=item.index,
                                       content_index=0, delta=ev.text, **extra))  # fmt: skip
            elif isinstance(ev, ToolCallStart):
                item = self._start(out, "function_call", new_id("fc"), ev.id, ev.name)
                self.calls[ev.index] = item
            elif isinstance(ev, ToolCallArguments):
                item = self.calls[ev.index]
                item.text.append(ev.text)
                out.append(self._event("response.function_call_arguments.delta", item_id=item.id,
                                       output_index=item.index, delta=ev.text))  # fmt: skip
        return out

    def end(self, result: ChoiceResult) -> list[bytes]:
        out: list[bytes] = []
        incomplete = result.finish_reason == "length"
        if not self.items:  # an empty reply is still one (empty) message, as in the body
            self._start(out, "message", new_id("msg"))
        self._close(out, "incomplete" if incomplete else "completed")
        status = "incomplete" if incomplete else "completed"
        final = self._response(status, [i.item(self._status(i, status)) for i in self.items],
                               usage_of(result))  # fmt: skip
        out.append(self._event(f"response.{status}", response=final))
        return out

    def failed(self, exc: APIError) -> list[bytes]:
        out = [self._event("error", code=exc.code, message=exc.message, param=exc.param)]
        code = "rate_limit_exceeded" if exc.status == 429 else "server_error"
        error = {"code": code, "message": exc.message}
        self.open = None  # the failed response lists the items as they were, incomplete
        items = [i.item("incomplete") for i in self.items]
        out.append(self._event("response.failed",
                               response=self._response("failed", items, None, error)))  # fmt: skip
        return out

    # -------------------------------------------------------------- items

    def _start(
        self, out: list[bytes], kind: str, item_id: str, call_id: str = "", name: str = ""
    ) -> _Item:
        self._close(out, "completed")
        item = _Item(kind, item_id, len(self.items), call_id=call_id, name=name)
        self.items.append(item)
        self.open = item
        added = item.item("in_progress")
        if kind != "function_call":
            added["content"] = []  # parts arrive with content_part.added
        out.append(self._event("response.output_item.added", output_index=item.index, item=added))
        if kind != "function_call":
            out.append(self._event("response.content_part.added", item_id=item.id,
                                   output_index=item.index, content_index=0,
                                   part=self._part(item, "")))  # fmt: skip
        return item

    def _close(self, out: list[bytes], status: str) -> None:
        item, self.open = self.open, None
        if item is None:
            return
        text = "".join(item.text)
        where = {"item_id": item.id, "output_index": item.index}
        if item.kind == "function_call":
            out.append(self._event("response.function_call_arguments.done", **where,
                                   name=item.name, arguments=text))  # fmt: skip
        else:
            if item.kind == "message":
                out.append(self._event("response.output_text.done", **where, content_index=0,
                                       text=text, logprobs=[]))  # fmt: skip
            else:
                out.append(self._event("response.reasoning_text.done", **where, content_index=0,
                                       text=text))  # fmt: skip
            out.append(self._event("response.content_part.done", **where, content_index=0,
                                   part=self._part(item, text)))  # fmt: skip
        out.append(self._event("response.output_item.done", output_index=item.index,
                               item=item.item(self._status(item, status))))  # fmt: skip

    @staticmethod
    def _status(item: _Item, status: str) -> str:
        # only a message's text is what max_output_tokens cuts; reasoning and calls are whole
        return status if item.kind == "message" else "completed"

    @staticmethod
    def _part(item: _Item, text: str) -> dict[str, Any]:
        if item.kind == "message":
            return text_part(text)
        return {"type": "reasoning_text", "text": text}

    def _response(
        self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        return response_object(self.call, self.id, self.model, self.created, status, output,
                               usage, error)  # fmt: skip

    def _event(self, kind: str, **fields: Any) -> bytes:
        obj = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event_bytes(kind, obj)
