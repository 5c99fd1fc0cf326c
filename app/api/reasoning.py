"""Reasoning models: the text between the template's thinking markers (`<think>`, `</think>`)
is reasoning, returned as `reasoning_content` (and `reasoning`), never as content.

A reply may start inside the block: DeepSeek-R1 templates, and Qwen3 ones whose generation
prompt already opens `<think>`, leave the opening marker in the prompt; the engine says so
(ModelInfo.reasoning_parser "think_open") and the plan starts the splitter inside. Only the first
block is reasoning (a later `<think>` is the model's content). Text that may be the beginning of
a marker is held back until it is known, so a marker never reaches the client, whole or split.
"""

from __future__ import annotations

START, END = "<think>", "</think>"


class ReasoningSplitter:
    """One choice's text -> ("reasoning" | "content", text) pieces, streamed."""

    def __init__(self, start_inside: bool = False, start: str = START, end: str = END) -> None:
        self.start, self.end = start, end
        self.state = "inside" if start_inside else "before"  # before | inside | after
        self.seen = start_inside  # a block was opened (reasoning is not None)
        self._buf = ""

    @property
    def inside(self) -> bool:
        return self.state == "inside"

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> list[tuple[str, str]]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        while self._buf:
            if self.state == "after":
                out.append(("content", self._buf))
                self._buf = ""
                break
            marker = self.start if self.state == "before" else self.end
            kind = "content" if self.state == "before" else "reasoning"
            at = self._buf.find(marker)
            if at >= 0:
                if at:
                    out.append((kind, self._buf[:at]))
                self._buf = self._buf[at + len(marker) :]
                self.state = "inside" if self.state == "before" else "after"
                self.seen = True
                continue
            keep = 0 if final else _partial(self._buf, marker)
            if len(self._buf) > keep:
                out.append((kind, self._buf[: len(self._buf) - keep]))
                self._buf = self._buf[len(self._buf) - keep :]
            break
        return out


def _partial(text: str, marker: str) -> int:
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
