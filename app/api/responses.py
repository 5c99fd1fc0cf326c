"""Engine replies -> OpenAI response objects and stream chunks (exact shapes of the API).

One `ChoiceState` per returned choice (prompt i, sequence j -> choice index i * n + j) collects
text, token count, logprobs and the finish reason; `Usage` sums them as OpenAI counts: the
prompt once per prompt, completions over every choice, cached tokens from the prefix cache.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from app.api.chat_output import (
    ChoiceEvent,
    ChoiceOutput,
    ChoiceReader,
    ContentDelta,
    ReasoningDelta,
    ToolCallStart,
)
from app.api.requests import GenerationPlan
from ipc import protocol as P


@dataclass(slots=True)
class ChoiceState:
    index: int
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[P.TokenLogprobs] = field(default_factory=list)
    finish: P.Finish | None = None
    reader: ChoiceReader | None = None  # chat: content, reasoning and tool calls
    events: list[ChoiceEvent] = field(default_factory=list)  # what the last add() read

    @property
    def finish_reason(self) -> str | None:
        if self.finish is None:
            return None
        if self.reader is not None and self.finish.reason != "length" and self.out.tool_calls:
            return "tool_calls"
        return self.finish.reason

    @property
    def out(self) -> ChoiceOutput:
        assert self.reader is not None
        return self.reader.output()


@dataclass(slots=True)
class Reply:
    """Everything about one API call's generation, filled as engine messages arrive."""

    plan: GenerationPlan
    model: str
    id: str = ""
    created: int = 0
    choices: list[ChoiceState] = field(default_factory=list)
    prompt_tokens: dict[int, tuple[int, int]] = field(default_factory=dict)  # prompt -> (n, cached)

    def __post_init__(self) -> None:
        prefix = "chatcmpl" if self.plan.kind == "chat" else "cmpl"
        self.id = self.id or f"{prefix}-{uuid.uuid4().hex}"
        self.created = self.created or int(time.time())
        total = self.plan.num_prompts * self.plan.sampling.n
        chat = self.plan.kind == "chat"
        self.choices = [
            ChoiceState(i, reader=ChoiceReader(self.plan) if chat else None) for i in range(total)
        ]

    def choice_of(self, prompt_index: int, seq_index: int) -> ChoiceState:
        return self.choices[prompt_index * self.plan.sampling.n + seq_index]

    def add(self, prompt_index: int, msg: P.Delta | P.Finish) -> ChoiceState:
        choice = self.choice_of(prompt_index, msg.index)
        if isinstance(msg, P.Delta):
            choice.text.append(msg.text)
            choice.num_tokens += len(msg.token_ids)
            if msg.logprobs:
                choice.logprobs.extend(msg.logprobs)
            if choice.reader is not None:
                choice.events = choice.reader.feed(msg.text, len(msg.token_ids))
        else:
            choice.finish = msg
            if choice.reader is not None:
                choice.events = choice.reader.finish()
            u = msg.usage
            if u.prompt_tokens or prompt_index not in self.prompt_tokens:
                self.prompt_tokens[prompt_index] = (u.prompt_tokens, u.cached_tokens)
        return choice

    def usage(self) -> dict[str, Any]:
        prompt = sum(n for n, _ in self.prompt_tokens.values())
        cached = sum(c for _, c in self.prompt_tokens.values())
        completion = sum(c.num_tokens for c in self.choices)
        usage: dict[str, Any] = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        if self.plan.reasoning:
            thinking = sum(c.out.reasoning_tokens for c in self.choices if c.reader is not None)
            usage["completion_tokens_details"] = {"reasoning_tokens": thinking}
        return usage

    # -------------------------------------------------------------- whole responses

    def response(self) -> dict[str, Any]:
        if self.plan.kind == "chat":
            choices = [
                {
                    "index": c.index,
                    "message": message_of(c.out),
                    "logprobs": self._chat_logprobs(c.logprobs) if self.plan.logprobs else None,
                    "finish_reason": c.finish_reason,
                }
                for c in self.choices
            ]
            obj = "chat.completion"
        else:
            choices = [
                {
                    "index": c.index,
                    "text": "".join(c.text),
                    "logprobs": self._completion_logprobs(c.logprobs, 0)
                    if self.plan.logprobs
                    else None,
                    "finish_reason": c.finish_reason,
                }
                for c in self.choices
            ]
            obj = "text_completion"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(),
        }

    # -------------------------------------------------------------- stream chunks

    def role_chunk(self, choice: ChoiceState) -> dict[str, Any]:
        """The first chunk of a chat choice: the assistant role and empty content."""
        return self._chunk(
            {
                "index": choice.index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        )

    def event_chunks(self, choice: ChoiceState, delta: P.Delta | None) -> list[dict[str, Any]]:
        """A chat choice's chunks for what its reader made of the last message (`delta`: the
        engine's, for its logprobs, which ride on the first chunk)."""
        lp = delta.logprobs if delta is not None and self.plan.logprobs else None
        entries = [delta_of(e) for e in choice.events]
        if not entries and lp:
            entries = [{"content": ""}]
        out = []
        for i, d in enumerate(entries):
            out.append(self._chunk({
                "index": choice.index,
                "delta": d,
                "logprobs": self._chat_logprobs(lp) if lp and i == 0 else None,
                "finish_reason": None,
            }))  # fmt: skip
        return out

    def delta_chunk(self, choice: ChoiceState, delta: P.Delta, offset: int) -> dict[str, Any]:
        """`offset`: characters of this choice's text before this delta (completions)."""
        lp = delta.logprobs if self.plan.logprobs else None
        if self.plan.kind == "chat":
            entry: dict[str, Any] = {
                "index": choice.index,
                "delta": {"content": delta.text},
                "logprobs": self._chat_logprobs(lp) if lp else None,
                "finish_reason": None,
            }
        else:
            entry = {
                "index": choice.index,
                "text": delta.text,
                "logprobs": self._completion_logprobs(lp, offset) if lp else None,
                "finish_reason": None,
            }
        return self._chunk(entry)

    def finish_chunk(self, choice: ChoiceState) -> dict[str, Any]:
        if self.plan.kind == "chat":
            entry: dict[str, Any] = {
                "index": choice.index,
                "delta": {},
                "logprobs": None,
                "finish_reason": choice.finish_reason,
            }
        else:
            entry = {
                "index": choice.index,
                "text": "",
                "logprobs": None,
                "finish_reason": choice.finish_reason,
            }
        return self._chunk(entry)

    def usage_chunk(self) -> dict[str, Any]:
        chunk = self._chunk(None)
        chunk["usage"] = self.usage()
        return chunk

    def _chunk(self, entry: dict[str, Any] | None) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.plan.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [] if entry is None else [entry],
        }
        if self.plan.include_usage:
            chunk["usage"] = None
        return chunk

    # -------------------------------------------------------------- logprobs

    @staticmethod
    def _chat_logprobs(entries: list[P.TokenLogprobs]) -> dict[str, Any]:
        return {
            "content": [
                {
                    "token": e.token,
                    "logprob": e.logprob,
                    "bytes": list(e.token.encode("utf-8")),
                    "top_logprobs": [
                        {"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode())}
                        for t in e.top
                    ],
                }
                for e in entries
            ],
            "refusal": None,
        }

    @staticmethod
    def _completion_logprobs(entries: list[P.TokenLogprobs], offset: int) -> dict[str, Any]:
        offsets = []
        for e in entries:
            offsets.append(offset)
            offset += len(e.token)
        return {
            "tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t.token: t.logprob for t in e.top} for e in entries],
            "text_offset": offsets,
        }


# ------------------------------------------------------------------ chat shapes


def message_of(out: ChoiceOutput) -> dict[str, Any]:
    """A read choice -> the chat message (content null when the reply is only calls)."""
    calls = out.tool_calls
    msg: dict[str, Any] = {
        "role": "assistant",
        "content": None if calls and not out.content.strip() else out.content,
    }
    if out.reasoning is not None:
        # vLLM's two names: reasoning_content (DeepSeek's, most clients) and reasoning (newer)
        msg["reasoning_content"] = msg["reasoning"] = out.reasoning
    if calls:
        msg["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls
        ]
    return msg


def delta_of(event: ChoiceEvent) -> dict[str, Any]:
    if isinstance(event, ContentDelta):
        return {"content": event.text}
    if isinstance(event, ReasoningDelta):
        return {"reasoning_content": event.text, "reasoning": event.text}
    if isinstance(event, ToolCallStart):
        fn = {"name": event.name, "arguments": ""}
        return {"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                                "function": fn}]}  # fmt: skip
    return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}
