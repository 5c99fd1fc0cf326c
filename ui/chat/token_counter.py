"""Token counts of chat text (attachments, the typed message) from the engine's own tokenizer.

The chat layer cannot reach the engine link (the window owns it), so the counter is given a
`send(request_id, text) -> bool` callable: True when the text went to an engine that answers with
`Tokenized` (ipc.protocol) under that request id, False when no tokenizer is reachable (no engine
yet, a remote HTTP server, the demo). The window hands every engine reply to `take_replies`, which
keeps the counter's own and returns the rest. Without an answer (False, an Error, or none within
`timeout_ms`) the count is `estimate_tokens`' and is marked estimated.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Hashable
from typing import Any

from PySide6.QtCore import QObject, QTimer, Signal

from ipc import protocol as P
from ui.chat.attachments import estimate_tokens

SendFn = Callable[[str, str], bool]  # (request_id, text) -> whether an engine will answer
REQUEST_PREFIX = "count-"  # never a chat request's id (those come from the chat panel)


class TokenCounter(QObject):
    counted = Signal(object, int, bool)  # key, tokens, estimated

    def __init__(self, send: SendFn | None = None, *, timeout_ms: int = 10_000,
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.send = send
        self.timeout_ms = timeout_ms
        self.max_model_len: int | None = None  # the engine's, from its last Tokenized
        self._prefix = f"{REQUEST_PREFIX}{os.urandom(4).hex()}-"  # one counter's ids apart
        self._ids = itertools.count(1)
        self._pending: dict[str, tuple[Hashable, str]] = {}  # request id -> key, text
        self._latest: dict[Hashable, str] = {}  # key -> its newest request id (older: stale)

    def count(self, key: Hashable, text: str) -> None:
        """Count `text` under `key`; `counted(key, n, estimated)` follows (at once when no
        engine is reachable). A newer count of the same key supersedes an older one."""
        rid = f"{self._prefix}{next(self._ids)}"
        self._latest[key] = rid
        if self.send is None or not self.send(rid, text):
            self._finish(rid, key, estimate_tokens(text), estimated=True)
            return
        self._pending[rid] = (key, text)
        QTimer.singleShot(self.timeout_ms, self, lambda: self._give_up(rid))

    def forget(self, key: Hashable) -> None:
        """No `counted` for `key` any more (its attachment was removed)."""
        rid = self._latest.pop(key, None)
        if rid is not None:
            self._pending.pop(rid, None)

    def pending(self) -> int:
        return len(self._pending)

    def take_replies(self, msgs: list[Any]) -> list[Any]:
        """Handle this counter's Tokenized / Error replies among `msgs`; return the others."""
        rest = []
        for msg in msgs:
            rid = getattr(msg, "request_id", None)
            if not (isinstance(rid, str) and rid.startswith(self._prefix)):
                rest.append(msg)
            elif isinstance(msg, P.Tokenized):
                self.max_model_len = msg.max_model_len
                self._answer(rid, len(msg.token_ids), estimated=False)
            elif rid in self._pending:  # an Error: the engine could not tokenize it
                self._answer(rid, estimate_tokens(self._pending[rid][1]), estimated=True)
        return rest

    def _answer(self, rid: str, n: int, *, estimated: bool) -> None:
        entry = self._pending.pop(rid, None)
        if entry is not None:
            self._finish(rid, entry[0], n, estimated=estimated)

    def _give_up(self, rid: str) -> None:
        entry = self._pending.get(rid)
        if entry is not None:  # no answer in time: the engine is gone or busy for long
            self._answer(rid, estimate_tokens(entry[1]), estimated=True)

    def _finish(self, rid: str, key: Hashable, n: int, *, estimated: bool) -> None:
        if self._latest.get(key) != rid:
            return  # superseded by a newer count, or forgotten
        del self._latest[key]
        self.counted.emit(key, n, estimated)
