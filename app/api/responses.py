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

from app.api.requests import GenerationPlan
from ipc import protocol as P


@dataclass(slots=True)
class ChoiceState:
    index: int
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[P.TokenLogprobs] = field(default_factory=list)
    finish: P.Finish | None = None

    @property
    def finish_reason(self) -> str | None:
        return None if self.finish is None else self.finish.reason


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
        self.choices = [ChoiceState(i) for i in range(total)]

    def choice_of(self, prompt_index: int, seq_index: int) -> ChoiceState:
        return self.choices[prompt_index * self.plan.sampling.n + seq_index]

    def add(self, prompt_index: int, msg: P.Delta | P.Finish) -> ChoiceState:
        choice = self.choice_of(prompt_index, msg.index)
        if isinstance(msg, P.Delta):
            choice.text.append(msg.text)
            choice.num_tokens += len(msg.token_ids)
            if msg.logprobs:
                choice.logprobs.extend(msg.logprobs)
        else:
            choice.finish = msg
            u = msg.usage
            if u.prompt_tokens or prompt_index not in self.prompt_tokens:
                self.prompt_tokens[prompt_index] = (u.prompt_tokens, u.cached_tokens)
        return choice

    def usage(self) -> dict[str, Any]:
        prompt = sum(n for n, _ in self.prompt_tokens.values())
        cached = sum(c for _, c in self.prompt_tokens.values())
        completion = sum(c.num_tokens for c in self.choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    # -------------------------------------------------------------- whole responses

    def response(self) -> dict[str, Any]:
        if self.plan.kind == "chat":
            choices = [
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": "".join(c.text)},
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
