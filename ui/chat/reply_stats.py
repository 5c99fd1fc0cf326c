"""A streamed reply's numbers: thinking tokens and time while it streams, and the stats line's
fields from the engine's Finish (or a server's over HTTP)."""

from __future__ import annotations

import time
from typing import Any

from app.conversations import Message
from ui.chat.thinking import split_thinking

# kept across the Finish that replaces a reply's stats
KEPT_KEYS = ("request_id", "forked_from")


def track_thinking(reply: Message, timing: dict, n: int, reasoning_open: bool,
                   finished: bool = False) -> None:  # fmt: skip
    """A reply's thinking tokens and time, into its stats: tokens counted while the block is
    open, the time from its first token to the answer's start (or the reply's end)."""
    if "thinking_s" in reply.stats:
        return
    split = split_thinking(reply.content, reasoning_open)
    if split.reasoning is None:
        return
    now = time.monotonic()
    t0 = timing.setdefault("think_t0", now)
    reply.stats["thinking_tokens"] = reply.stats.get("thinking_tokens", 0) + n
    if not split.thinking or finished:
        reply.stats["thinking_s"] = now - t0


def finish_stats(msg: Any) -> dict:
    """From an engine Finish, or a server's over HTTP (ui/remote/link.py), which may lack usage
    (None) or cached tokens (usage.cached_tokens None)."""
    u = msg.usage
    n = u.completion_tokens if u is not None else 0
    tok_s = None
    if msg.tpot:
        tok_s = 1.0 / msg.tpot
    elif msg.e2e and msg.ttft is not None and n > 1 and msg.e2e > msg.ttft:
        tok_s = (n - 1) / (msg.e2e - msg.ttft)
    stats = {"ttft": msg.ttft, "tok_s": tok_s, "finish_reason": msg.reason, "e2e": msg.e2e}
    if u is not None:
        stats |= {"prompt_tokens": u.prompt_tokens, "cached_tokens": u.cached_tokens,
                  "completion_tokens": n}
        # speculative decoding: drafts verified for this reply and confirmed (absent from a
        # server's usage over HTTP, and 0 from engines that do not speculate)
        drafted = getattr(u, "draft_tokens", 0) or 0
        if drafted:
            stats |= {"draft_tokens": drafted,
                      "accepted_draft_tokens": getattr(u, "accepted_draft_tokens", 0) or 0}
    return stats


def finished(reply: Message, msg: Any) -> None:
    """The Finish replaces the streaming stats; thinking and branch bookkeeping stay."""
    kept = {k: v for k, v in reply.stats.items() if k.startswith("thinking_") or k in KEPT_KEYS}
    reply.stats = kept | finish_stats(msg)
    if msg.reason in ("abort", "error"):
        reply.interrupted = True
        reply.stats["interrupted_by"] = (
            "stopped" if msg.reason == "abort" else f"error: {msg.error or ''}")
