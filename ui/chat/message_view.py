"""One turn of the transcript: role, text (a reply's as Markdown), a Copy button, a reply's
thinking block and its stats line."""

from __future__ import annotations

import math

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QSizePolicy,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app.conversations import Message
from ui import theme
from ui.chat.answer_view import CURSOR, AnswerView
from ui.chat.branch_nav import BranchNav
from ui.chat.fit_label import FitLabel
from ui.chat.thinking import split_thinking

# Replies render as Markdown; False gives the plain-text view it replaced (ui/chat/bench_stream.py
# flips it to time both in one process).
MARKDOWN = True
RENDER_INTERVAL_MS = 50  # a streaming reply re-renders at most this often (~20 times a second)

ROLE_STYLE = {
    "user": ("You", "#2a3342"),
    "assistant": ("Assistant", "#23272f"),
}


def format_stats(stats: dict) -> str:
    """'TTFT 120 ms · 31.2 tok/s · prompt 45 / cached 32 / generated 100 · drafts 31/40
    accepted (78%) · stop' (the drafts: a reply the engine decoded speculatively)."""
    if not stats:
        return ""
    parts = []
    ttft = stats.get("ttft")
    if isinstance(ttft, int | float) and math.isfinite(ttft):
        parts.append(f"TTFT {ttft * 1000:.0f} ms")
    tps = stats.get("tok_s")
    if isinstance(tps, int | float) and math.isfinite(tps):
        parts.append(f"{tps:.1f} tok/s")
    if "prompt_tokens" in stats:
        cached = stats.get("cached_tokens", 0)
        # a server over HTTP may not report cached tokens: say nothing rather than 0
        parts.append(f"prompt {stats['prompt_tokens']}"
                     + (f" / cached {cached}" if cached is not None else "")
                     + f" / generated {stats.get('completion_tokens', 0)}")
    drafted = stats.get("draft_tokens")
    if isinstance(drafted, int) and drafted > 0:
        accepted = stats.get("accepted_draft_tokens", 0)
        parts.append(f"drafts {accepted}/{drafted} accepted ({accepted / drafted:.0%})")
    if stats.get("forked_from") and stats.get("cached_tokens"):
        parts.append(f"{stats['cached_tokens']} prompt tokens reused from the earlier branch")
    if stats.get("finish_reason"):
        parts.append(str(stats["finish_reason"]))
    if stats.get("error"):
        parts.append(str(stats["error"]))
    return " · ".join(parts)


def thinking_title(stats: dict, thinking_now: bool) -> str:
    """'Thinking… 42 tokens' while it thinks; 'Thought for 3.1 s · 120 tokens' after."""
    n = stats.get("thinking_tokens")
    tokens = f"{n} token{'s' if n != 1 else ''}" if isinstance(n, int) else ""
    if thinking_now:
        return "Thinking…" + (f" {tokens}" if tokens else "")
    seconds = stats.get("thinking_s")
    parts = [f"Thought for {seconds:.1f} s" if isinstance(seconds, int | float) else "Thought"]
    if tokens:
        parts.append(tokens)
    return " · ".join(parts)


class MessageView(QFrame):
    """One turn: role header with a Copy button, (replies) a collapsible dimmed thinking block,
    the text, and (for replies) the stats line. The block is open while the model thinks and
    closes once when the answer starts; the user may open it again.

    A reply's answer is Markdown (ui/chat/answer_view.py); a user's text stays literal. While a
    reply streams, `refresh(streaming=True)` only marks it dirty and a single-shot timer renders
    it (at most every RENDER_INTERVAL_MS); `refresh()` renders at once, so the final text is
    exact.

    The header carries `‹ i/n ›` when the turn has sibling branches (`branch_step`) and, on a
    user turn, Edit (`edit_requested`: the panel puts the text back in the input box)."""

    branch_step = Signal(int)
    edit_requested = Signal()

    def __init__(self, msg: Message, parent: QWidget | None = None,
                 thinking_opens_reply: bool = False, markdown: bool | None = None) -> None:
        super().__init__(parent)
        self.msg = msg
        self.thinking_opens_reply = thinking_opens_reply  # the prompt opened <think> already
        # rich: Markdown replies, self-sizing labels and coalesced streaming; else the old view
        self.rich = MARKDOWN if markdown is None else markdown
        self.markdown = self.rich and msg.role == "assistant"
        self.render_count = 0
        self._closed_once = False
        self._render_timer = QTimer(self)
        self._render_timer.setSingleShot(True)
        self._render_timer.setInterval(RENDER_INTERVAL_MS)
        self._render_timer.timeout.connect(lambda: self._render(streaming=True))
        name, bg = ROLE_STYLE.get(msg.role, (msg.role, "#23272f"))
        self.setObjectName("msg")
        self.setStyleSheet(f"QFrame#msg {{ background: {bg}; border-radius: 6px; }}")
        lay = QVBoxLayout(self)
        lay.setContentsMargins(10, 6, 10, 6)
        lay.setSpacing(2)
        head = QLabel(name)
        head.setStyleSheet(f"color: {theme.ACCENT if msg.role == 'user' else '#9fd39f'};"
                           "font-weight: bold;")
        self.copy_btn = QToolButton()
        self.copy_btn.setText("Copy")
        self.copy_btn.setAutoRaise(True)
        self.copy_btn.setToolTip("Copy this message's text")
        self.copy_btn.setStyleSheet(f"color: {theme.MUTED}; font-size: 8pt;")
        self.copy_btn.clicked.connect(self.copy_text)
        self.branch_nav = BranchNav()
        self.branch_nav.stepped.connect(self.branch_step.emit)
        self.edit_btn = QToolButton(text="Edit", autoRaise=True)
        self.edit_btn.setToolTip("Edit this message: sending it makes a new branch")
        self.edit_btn.setStyleSheet(f"color: {theme.MUTED}; font-size: 8pt;")
        self.edit_btn.clicked.connect(self.edit_requested.emit)
        self.edit_btn.setVisible(msg.role == "user")
        head_row = QHBoxLayout()
        head_row.setContentsMargins(0, 0, 0, 0)
        head_row.addWidget(head)
        head_row.addWidget(self.branch_nav)
        head_row.addStretch(1)
        head_row.addWidget(self.edit_btn)
        head_row.addWidget(self.copy_btn)
        self.attachments_line = self._wrapped_label()
        self.attachments_line.setStyleSheet(f"color: {theme.MUTED}; font-size: 8pt;")
        files = [a.get("name", "?") + (f" ({a['tokens']:,} tokens)" if a.get("tokens") else "")
                 for a in msg.attachments]
        self.attachments_line.setText("📎 " + " · ".join(files) if files else "")
        self.attachments_line.setVisible(bool(files))
        self.think_toggle = QToolButton()
        self.think_toggle.setCheckable(True)
        self.think_toggle.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.think_toggle.setAutoRaise(True)
        self.think_toggle.setStyleSheet(f"color: {theme.MUTED}; font-size: 8pt;")
        self.think_toggle.toggled.connect(self._on_think_toggled)
        self.think_text = self._wrapped_label()
        self.think_text.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.think_text.setStyleSheet(
            f"color: {theme.MUTED}; font-style: italic; border-left: 2px solid {theme.MUTED};"
            " padding-left: 6px;")
        self.text: AnswerView | QLabel = AnswerView() if self.markdown else self._wrapped_label()
        self.text.setTextInteractionFlags(self.text.textInteractionFlags()
                                          | Qt.TextInteractionFlag.TextSelectableByMouse)
        self.stats = self._wrapped_label()
        self.stats.setStyleSheet(f"color: {theme.MUTED}; font-size: 8pt;")
        lay.addLayout(head_row)
        lay.addWidget(self.think_toggle)
        lay.addWidget(self.think_text)
        lay.addWidget(self.text)
        lay.addWidget(self.attachments_line)
        lay.addWidget(self.stats)
        self.think_toggle.setVisible(False)
        self.think_text.setVisible(False)
        self.refresh()

    def set_branch(self, index: int, count: int) -> None:
        self.branch_nav.set_position(index, count)

    def set_flash(self, on: bool) -> None:
        """A search hit brought into view: outline it for a moment."""
        bg = ROLE_STYLE.get(self.msg.role, ("", "#23272f"))[1]
        border = f"border: 2px solid {theme.ACCENT};" if on else ""
        self.setStyleSheet(f"QFrame#msg {{ background: {bg}; border-radius: 6px; {border} }}")

    def _wrapped_label(self) -> QLabel:
        if self.rich:
            return FitLabel()  # no height-for-width: see ui/chat/fit_label.py
        label = QLabel()
        label.setTextFormat(Qt.TextFormat.PlainText)
        label.setWordWrap(True)
        label.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Minimum)
        return label

    @property
    def render_pending(self) -> bool:
        """A streamed change waits for the render timer."""
        return self._render_timer.isActive()

    def refresh(self, streaming: bool = False) -> None:
        if streaming and self.rich:  # the old view renders each change, as it always did
            if not self._render_timer.isActive():
                self._render_timer.start()
            return
        self._render_timer.stop()
        self._render(streaming)

    def answer(self) -> str:
        """The message's own text: a reply's answer without its thinking block."""
        if self.msg.role != "assistant":
            return self.msg.content
        return split_thinking(self.msg.content, self.thinking_opens_reply).answer

    def copy_text(self) -> None:
        QGuiApplication.clipboard().setText(self.answer())

    def _render(self, streaming: bool) -> None:
        self.render_count += 1
        if self.msg.role == "assistant":
            split = split_thinking(self.msg.content, self.thinking_opens_reply)
            answer = split.answer
            self._show_thinking(split.reasoning, split.thinking, streaming)
        else:
            answer = self.msg.content  # user text stays literal
        if isinstance(self.text, AnswerView):
            self.text.set_markdown(answer, cursor=streaming)
        else:
            self.text.setText(answer + (CURSOR if streaming else ""))
        self.text.setVisible(bool(answer) or (streaming and not self.think_toggle.isChecked()))
        self.copy_btn.setVisible(bool(answer) and not streaming)
        line = format_stats(self.msg.stats)
        if self.msg.interrupted:
            why = self.msg.stats.get("interrupted_by", "interrupted")
            line = (line + " · " if line else "") + f"⚠ {why}"
            self.stats.setStyleSheet("color: #ff8a80; font-size: 8pt;")
        self.stats.setText(line)
        self.stats.setVisible(self.msg.role == "assistant" and bool(line))

    def _show_thinking(self, reasoning: str | None, open_block: bool, streaming: bool) -> None:
        thinking_now = open_block and streaming
        if reasoning is None:
            self.think_toggle.setVisible(False)
            self.think_text.setVisible(False)
            return
        self.think_toggle.setVisible(True)
        self.think_toggle.setText(thinking_title(self.msg.stats, thinking_now))
        self.think_text.setText(reasoning)
        if thinking_now and not self._closed_once:
            self.think_toggle.setChecked(True)
        elif not open_block and not self._closed_once:
            self._closed_once = True  # the answer started (or the reply was loaded): close once
            self.think_toggle.setChecked(False)
        self._on_think_toggled(self.think_toggle.isChecked())

    def _on_think_toggled(self, open_: bool) -> None:
        self.think_toggle.setArrowType(Qt.ArrowType.DownArrow if open_ else Qt.ArrowType.RightArrow)
        self.think_text.setVisible(open_ and not self.think_toggle.isHidden())
