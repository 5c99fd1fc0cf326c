"""One chat choice served through another API's shapes (the Responses API, the Messages API).

Both APIs are translations over the chat core: their request becomes a chat GenerationPlan
(openai_responses.py, anthropic_messages.py), the engine streams text, and a `ChoiceReader`
(chat_output.py) reads it into content, reasoning and tool calls. What differs is only the
shape of the reply, so each API supplies an `APIEncoder` and this module drives it:

    collect(gen, run)                  -> ChoiceResult (the whole reply: encoder.body(result))
    stream(gen, run, encoder, first)   -> the encoder's SSE bytes, begin to end

A request of these APIs is always one choice (neither has `n`).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from app.api.chat_output import ChoiceEvent, ChoiceOutput, ChoiceReader
from app.api.errors import APIError
from app.api.generation import Generation
from app.api.requests import GenerationPlan
from ipc import protocol as P
from ipc.client import EngineError

log = logging.getLogger(__name__)


class Reader(Protocol):
    """What chat_output.ChoiceReader offers (the tools branch's reader of one choice's text)."""

    def feed(self, text: str, num_tokens: int = 0) -> list[ChoiceEvent]: ...

    def finish(self) -> list[ChoiceEvent]: ...

    def output(self) -> ChoiceOutput: ...


ReaderFactory = Callable[[GenerationPlan], Reader]


def default_reader(plan: GenerationPlan) -> Reader:
    return ChoiceReader(plan)


@dataclass(slots=True)
class ChoiceResult:
    """A finished choice: what the reader made of its text, and the engine's counts."""

    output: ChoiceOutput
    finish_reason: str  # "stop" | "length" (abort and error end the call with an APIError)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    stop_sequence: str | None = None  # the stop string that ended it, when one did


@dataclass(slots=True)
class ChoiceRun:
    """Engine messages of one choice -> ChoiceEvents, then the ChoiceResult."""

    reader: Reader
    token_ids: list[int] = field(default_factory=list)
    finish: P.Finish | None = None

    def add(self, msg: P.Delta | P.Finish) -> list[ChoiceEvent]:
        if isinstance(msg, P.Delta):
            self.token_ids.extend(msg.token_ids)
            # the token count lets the reader count reasoning tokens
            return self.reader.feed(msg.text, num_tokens=len(msg.token_ids)) if msg.text else []
        self.finish = msg
        return self.reader.finish()

    def result(self) -> ChoiceResult:
        assert self.finish is not None, "the choice has not finished"
        u = self.finish.usage
        return ChoiceResult(
            output=self.reader.output(),
            finish_reason=self.finish.reason,
            prompt_tokens=u.prompt_tokens,
            cached_tokens=u.cached_tokens,
            completion_tokens=u.completion_tokens or len(self.token_ids),
        )


class APIEncoder(Protocol):
    """One API's view of one choice: its stream events (bytes, ready to send) and its body."""

    id: str  # the reply's id ("resp_…", "msg_…"), also the engine request's origin

    def begin(self) -> list[bytes]: ...

    def events(self, events: list[ChoiceEvent]) -> list[bytes]: ...

    def end(self, result: ChoiceResult) -> list[bytes]: ...

    def failed(self, exc: APIError) -> list[bytes]: ...

    def body(self, result: ChoiceResult) -> dict[str, Any]: ...


async def collect(gen: Generation, run: ChoiceRun) -> ChoiceResult:
    async for _, msg in gen.events():
        run.add(msg)
    return await _finished(gen, run)


async def stream(
    gen: Generation, run: ChoiceRun, encoder: APIEncoder, first: list[tuple[int, Any]]
) -> AsyncIterator[bytes]:
    """The encoder's events for the whole choice. `first`: the messages streaming.first_events
    already took (so that a refused request got its 4xx before the 200). An error after the
    200 went out ends the stream with the encoder's error events."""
    try:
        for chunk in encoder.begin():
            yield chunk
        for _, msg in first:
            for chunk in encoder.events(run.add(msg)):
                yield chunk
        async for _, msg in gen.events():
            for chunk in encoder.events(run.add(msg)):
                yield chunk
        result = await _finished(gen, run)
        for chunk in encoder.end(result):
            yield chunk
    except APIError as exc:
        log.info("stream of %s ended by an error: %s", gen.origin_id, exc.message)
        for chunk in encoder.failed(exc):
            yield chunk
    except Exception as exc:  # a bug here: the client still gets an end it can read
        log.exception("stream of %s failed", gen.origin_id)
        for chunk in encoder.failed(APIError(500, f"internal server error: {exc}")):
            yield chunk


async def _finished(gen: Generation, run: ChoiceRun) -> ChoiceResult:
    result = run.result()
    stops = gen.plan.sampling.stop
    if stops and result.finish_reason == "stop" and run.token_ids:
        result.stop_sequence = await matched_stop(gen, run.token_ids, stops)
    return result


async def matched_stop(gen: Generation, token_ids: list[int], stops: list[str]) -> str | None:
    """Which stop string ended the choice. The engine's Finish says only "stop" (an end-of-
    sequence token or a stop string) and trims the stop string from the text; the generated
    tokens still hold it, and the engine stops at the first match, so any stop string found in
    their full text is the one that stopped it (none found: end of sequence)."""
    try:
        text = (await gen.client.detokenize(token_ids)).text
    except EngineError as exc:  # the answer loses only its stop_sequence detail
        log.warning("could not detokenize to find the stop string: %s", exc)
        return None
    found = [(text.find(s), s) for s in stops if s in text]
    return min(found)[1] if found else None
