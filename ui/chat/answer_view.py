"""A reply's answer as rendered Markdown: a read-only, selectable QTextBrowser that is exactly as
tall as its document (the transcript scrolls, not each message), whose `copy:N` links put code
block N on the clipboard and whose web and mail links open outside the app."""

from __future__ import annotations

import math
from typing import Any

from PySide6.QtCore import QSizeF, Qt, QUrl
from PySide6.QtGui import QDesktopServices, QGuiApplication, QTextCursor
from PySide6.QtWidgets import QFrame, QSizePolicy, QTextBrowser, QWidget

from ui.chat.markdown import LINK_SCHEMES, CodeBlock, render_markdown

CURSOR = " ▍"  # shown after the text while a reply streams


class AnswerView(QTextBrowser):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.source_text = ""  # the Markdown shown now
        self.code_blocks: list[CodeBlock] = []
        self.renders = 0  # how many times the document was rebuilt (the streaming cost)
        self._cursor = False
        self._rebuilding = False
        self.setOpenLinks(False)  # links come to _on_anchor; nothing navigates the view
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setMinimumWidth(40)
        self.setStyleSheet("QTextBrowser { background: transparent; }")
        self.viewport().setAutoFillBackground(False)
        self.document().setDocumentMargin(2)
        self.document().setIndentWidth(20)  # Qt's 40 px per list level is wide for a chat
        self.setTextInteractionFlags(
            Qt.TextInteractionFlag.TextBrowserInteraction
            | Qt.TextInteractionFlag.TextSelectableByKeyboard)
        self.anchorClicked.connect(self._on_anchor)
        self.document().documentLayout().documentSizeChanged.connect(self._fit_height)
        self._fit_height(self.document().size())

    def set_markdown(self, text: str, cursor: bool = False) -> None:
        if text == self.source_text and cursor == self._cursor:
            return  # e.g. the reply is still thinking: its answer has not changed
        rendered = render_markdown(text)
        self.source_text, self.code_blocks, self._cursor = text, rendered.code_blocks, cursor
        self.renders += 1
        # setHtml empties the document first: fitting to that would resize the widget twice and
        # re-lay-out the whole transcript each time, so fit once, to the finished document
        self._rebuilding = True
        try:
            self.setHtml(rendered.html)
            if cursor:  # after rendering, so the cursor never changes how the Markdown parses
                end = QTextCursor(self.document())
                end.movePosition(QTextCursor.MoveOperation.End)
                end.insertText(CURSOR)
        finally:
            self._rebuilding = False
        self._fit_height(self.document().size())

    def text(self) -> str:
        """The Markdown source shown (with the streaming cursor), as QLabel.text() was."""
        return self.source_text + (CURSOR if self._cursor else "")

    def loadResource(self, type_: int, name: QUrl) -> Any:  # noqa: N802 - Qt's name
        return None  # model output never makes the app read a file or fetch a URL

    def _on_anchor(self, url: QUrl) -> None:
        if url.scheme() == "copy":
            self.copy_code(int(url.path()) if url.path().isdigit() else -1)
        elif (url.scheme().lower() + ":") in LINK_SCHEMES:
            QDesktopServices.openUrl(url)

    def copy_code(self, index: int) -> None:
        if 0 <= index < len(self.code_blocks):
            QGuiApplication.clipboard().setText(self.code_blocks[index].code)

    def _fit_height(self, size: QSizeF) -> None:
        if self._rebuilding:
            return
        h = math.ceil(size.height()) + 2 * self.frameWidth()
        if h != self.height():
            self.setFixedHeight(h)
