"""The replies in flight: which request streams into which conversation's message, and what each
engine message (Delta, Finish, Error from ipc.protocol) does to it. No widgets here."""

from __future__ import annotations

import itertools
import time
from typing import Any

from app.conversations import Message
from ui.chat import reply_stats


class ReplyTracker:
    def __init__(self) -> None:
        # rid -> (conv id, reply, {"n": tokens streamed so far, "think_t0": …})
        self.active: dict[str, tuple[str, Message, dict]] = {}
        self.last_request: dict[str, str] = {}  # conv id -> latest request id
        self._seq = itertools.count(1)

    def start(self, conv_id: str, reply: Message) -> str:
        rid = f"chat-{conv_id}-{next(self._seq)}-{int(time.time() * 1000) % 100000}"
        self.active[rid] = (conv_id, reply, {"n": 0})
        self.last_request[conv_id] = rid
        return rid

    def busy(self, conv_id: str | None) -> bool:
        return conv_id is not None and any(c == conv_id for c, _, _ in self.active.values())

    def requests_of(self, conv_id: str) -> list[str]:
        return [rid for rid, (c, _, _) in self.active.items() if c == conv_id]

    def streaming_ids(self) -> set[int]:
        return {id(m) for _, m, _ in self.active.values()}

    def apply(self, msgs: list[Any], reasoning_open: bool) -> list[tuple[str, str, Message]]:
        """Fold engine messages into their replies; returns (rid, conv id, reply) per change."""
        changed = []
        for msg in msgs:
            rid = getattr(msg, "request_id", None)
            entry = self.active.get(rid) if rid else None
            if entry is None:
                continue  # not ours, or a late delta of a finished request
            conv_id, reply, timing = entry
            kind = type(msg).__name__
            if kind in ("Delta", "Finish") and msg.index != 0:
                continue
            if kind == "Delta":
                reply.content += msg.text
                timing["n"] += len(msg.token_ids)
                reply_stats.track_thinking(reply, timing, len(msg.token_ids), reasoning_open)
            elif kind == "Finish":
                reply_stats.track_thinking(reply, timing, 0, reasoning_open, finished=True)
                reply_stats.finished(reply, msg)
                del self.active[rid]
            elif kind == "Error":
                if getattr(msg, "code", "") == "unknown_request":
                    continue  # an abort that raced the finish
                reply.interrupted = True
                why = ("interrupted: " + msg.message if msg.code == "engine_unreachable"
                       else "engine refused the request")
                reply.stats = dict(reply.stats) | {"error": f"[{msg.code}] {msg.message}",
                                                   "interrupted_by": why}
                del self.active[rid]
            else:
                continue
            changed.append((rid, conv_id, reply))
        return changed

    def interrupt_all(self, why: str) -> list[tuple[str, Message]]:
        """The engine is gone: every streaming reply keeps its text and is marked interrupted."""
        out = []
        for conv_id, reply, timing in self.active.values():
            reply.interrupted = True
            reply.stats = dict(reply.stats) | {"interrupted_by": why,
                                              "completion_tokens": timing["n"]}
            out.append((conv_id, reply))
        self.active.clear()
        return out
