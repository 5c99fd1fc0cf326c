"""Token ids as text through the watched server's `POST /detokenize` (vLLM and KVScope:
{"model", "tokens": [...]} -> {"prompt": "..."}; llama.cpp's server answers {"content": ...},
some servers {"text": ...}: all are read), for the prefix tree's hover. One worker thread
asks; the GUI thread only reads a cache (`text`), which says None until the answer is in (the
hover shows the ids meanwhile) and for good once the server turns out to have no such route.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading

import httpx
from PySide6.QtCore import QObject, Signal

log = logging.getLogger(__name__)

Tokens = tuple[int, ...]
NO_ROUTE = (404, 405, 501)  # the server has no /detokenize
ANSWER_KEYS = ("prompt", "text", "content")


class Detokenizer(QObject):
    text_ready = Signal(object, str)  # tokens, text (on the GUI thread)
    _answer = Signal(object, object)  # from the worker: tokens, text or None (no route)

    def __init__(self, url: str, api_key: str | None = None, model: str | None = None, *,
                 timeout: float = 5.0, cache_size: int = 4096,
                 parent: QObject | None = None) -> None:  # fmt: skip
        super().__init__(parent)
        self.url = url.rstrip("/") + "/detokenize"
        self.api_key = api_key
        self.model = model  # older vLLM versions require it
        self.timeout = timeout
        self.supported: bool | None = None  # None until the server has answered once
        self._cache: collections.OrderedDict[Tokens, str] = collections.OrderedDict()
        self._cache_size = cache_size
        self._asked: set[Tokens] = set()
        self._queue: queue.Queue[Tokens | None] = queue.Queue(maxsize=32)
        self._thread: threading.Thread | None = None
        self._answer.connect(self._on_answer)

    def text(self, tokens: Tokens) -> str | None:
        """The text of `tokens` when known; else None, and the server is asked (once)."""
        if self.supported is False:
            return None
        text = self._cache.get(tokens)
        if text is not None:
            self._cache.move_to_end(tokens)
            return text
        if tokens not in self._asked:
            try:
                self._queue.put_nowait(tokens)
            except queue.Full:  # the mouse moves faster than the server answers: ask later
                return None
            if len(self._asked) > 4 * self._cache_size:
                self._asked = set(self._cache)  # forget old failures rather than grow
            self._asked.add(tokens)
            self._ensure_thread()
        return None

    def close(self) -> None:
        if self._thread is not None:
            try:
                self._queue.put_nowait(None)
            except queue.Full:
                pass

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvscope-detokenize",
                                            daemon=True)
            self._thread.start()

    def _run(self) -> None:
        headers = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        with httpx.Client(timeout=self.timeout, headers=headers) as http:
            while (tokens := self._queue.get()) is not None:
                try:
                    self._answer.emit(tokens, self._ask(http, tokens))
                except RuntimeError:  # the window moved on
                    return

    def _ask(self, http: httpx.Client, tokens: Tokens) -> str | None | Exception:
        body: dict = {"tokens": list(tokens)}
        if self.model:
            body["model"] = self.model
        try:
            r = http.post(self.url, json=body)
        except httpx.HTTPError as exc:
            return exc
        if r.status_code in NO_ROUTE:
            return None
        try:
            answer = r.json() if r.status_code == 200 else {}
        except ValueError:
            answer = {}
        text = next((answer[k] for k in ANSWER_KEYS if isinstance(answer.get(k), str)), None)
        return text if text is not None else ValueError(f"HTTP {r.status_code}: {r.text[:80]}")

    def _on_answer(self, tokens: Tokens, text: str | None | Exception) -> None:
        if text is None:
            if self.supported is None:
                log.info("%s: no such route; the prefix tree shows token ids", self.url)
            self.supported = False
            return
        if isinstance(text, Exception):
            log.info("detokenizing for the prefix tree failed: %s", text)
            return  # stays asked: not again for these tokens
        self.supported = True
        self._cache[tokens] = text
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        self.text_ready.emit(tokens, text)
