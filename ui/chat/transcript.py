"""The scrolling column of turns. It follows the bottom while a reply streams unless the user
scrolled up, and can bring one message into view (a search hit) and flash it."""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import QScrollArea, QVBoxLayout, QWidget

from app.conversations import Message
from ui.chat.message_view import MessageView

FLASH_MS = 1200


class Transcript(QScrollArea):
    def __init__(self, make_view: Callable[[Message, bool], MessageView],
                 parent: QWidget | None = None) -> None:  # fmt: skip
        super().__init__(parent)
        self._make_view = make_view
        self.column = QWidget()
        self.lay = QVBoxLayout(self.column)
        self.lay.setContentsMargins(4, 4, 4, 4)
        self.lay.setSpacing(6)
        self.lay.addStretch(1)
        self.setWidgetResizable(True)
        self.setWidget(self.column)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.verticalScrollBar().rangeChanged.connect(self._follow)
        self.verticalScrollBar().valueChanged.connect(self._on_scrolled)
        self.stick_to_bottom = True
        self.views: list[MessageView] = []

    def show_messages(self, messages: list[Message], streaming: set[int]) -> None:
        """Replace the column with `messages` (ids in `streaming` still receive text)."""
        for v in self.views:
            v.setParent(None)
            v.deleteLater()
        self.views = []
        for m in messages:
            self.append(m, streaming=id(m) in streaming)
        self.stick_to_bottom = True

    def append(self, m: Message, streaming: bool = False) -> MessageView:
        v = self._make_view(m, streaming)
        self.lay.insertWidget(self.lay.count() - 1, v)
        self.views.append(v)
        return v

    def view_for(self, m: Message) -> MessageView | None:
        for v in reversed(self.views):
            if v.msg is m:
                return v
        return None

    def reveal(self, m: Message) -> bool:
        """Scroll `m` into view and flash its frame; False when it is not shown."""
        v = self.view_for(m)
        if v is None:
            return False
        self.stick_to_bottom = False
        self.column.layout().activate()  # geometry of freshly added views
        self.ensureWidgetVisible(v, 0, 40)
        v.set_flash(True)
        QTimer.singleShot(FLASH_MS, v, lambda: v.set_flash(False))  # dropped if v goes first
        return True

    def _on_scrolled(self, value: int) -> None:
        self.stick_to_bottom = value >= self.verticalScrollBar().maximum() - 30

    def _follow(self, _lo: int, hi: int) -> None:
        if self.stick_to_bottom:
            self.verticalScrollBar().setValue(hi)
