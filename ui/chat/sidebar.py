"""The chat's left column: the conversation list (New, Rename, Delete) and search.

Typing in the search field (Ctrl+F) swaps the list for the hits across every conversation and
branch, titles first; activating a hit emits `jump(conversation id, message id or "")`. Esc or an
empty field brings the list back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import (
    QAbstractItemView,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QPushButton,
    QStackedWidget,
    QVBoxLayout,
    QWidget,
)

from ui import theme

HIT_ROLE = Qt.ItemDataRole.UserRole + 1


class ConversationSidebar(QWidget):
    new_requested = Signal()
    rename_requested = Signal()
    delete_requested = Signal()
    jump = Signal(str, str)  # conversation id, message id ("" = the conversation itself)

    def __init__(self, search: Callable[[str], Iterable[tuple[str, Any]]],
                 parent: QWidget | None = None) -> None:  # fmt: skip
        super().__init__(parent)
        self._search = search
        self.search_edit = QLineEdit()
        self.search_edit.setPlaceholderText("Search chats (Ctrl+F)")
        self.search_edit.setClearButtonEnabled(True)
        self.search_edit.textChanged.connect(self._on_text)
        self.search_edit.returnPressed.connect(self._activate_first)
        self._search_timer = QTimer(self)  # search once typing pauses, not per key
        self._search_timer.setSingleShot(True)
        self._search_timer.setInterval(150)
        self._search_timer.timeout.connect(self.run_search)

        self.list = QListWidget()
        self.list.setEditTriggers(QAbstractItemView.EditTrigger.DoubleClicked
                                  | QAbstractItemView.EditTrigger.EditKeyPressed)
        self.results = QListWidget()
        self.results.setWordWrap(True)
        self.results.itemActivated.connect(self._on_hit)
        self.results.itemClicked.connect(self._on_hit)
        self.result_count = QLabel()
        self.result_count.setStyleSheet(f"color: {theme.MUTED}; font-size: 8pt;")
        results_page = QWidget()
        rl = QVBoxLayout(results_page)
        rl.setContentsMargins(0, 0, 0, 0)
        rl.addWidget(self.result_count)
        rl.addWidget(self.results, 1)
        self.stack = QStackedWidget()
        self.stack.addWidget(self.list)
        self.stack.addWidget(results_page)

        buttons = QHBoxLayout()
        for text, sig in (("New", self.new_requested), ("Rename", self.rename_requested),
                          ("Delete", self.delete_requested)):
            b = QPushButton(text)
            b.clicked.connect(sig.emit)
            buttons.addWidget(b)
        self.lay = QVBoxLayout(self)
        self.lay.setContentsMargins(0, 0, 0, 0)
        self.lay.addWidget(QLabel("Conversations"))
        self.lay.addWidget(self.search_edit)
        self.lay.addWidget(self.stack, 1)
        self.lay.addLayout(buttons)

    # --- the conversation list ----------------------------------------------------------------
    def add_item(self, conv_id: str, title: str, tooltip: str = "",
                 top: bool = False) -> QListWidgetItem:  # fmt: skip
        item = QListWidgetItem(title)
        item.setData(Qt.ItemDataRole.UserRole, conv_id)
        item.setFlags(item.flags() | Qt.ItemFlag.ItemIsEditable)
        item.setToolTip(tooltip)
        self.list.blockSignals(True)
        if top:
            self.list.insertItem(0, item)
        else:
            self.list.addItem(item)
        self.list.blockSignals(False)
        return item

    def item_for(self, conv_id: str) -> QListWidgetItem | None:
        for i in range(self.list.count()):
            item = self.list.item(i)
            if item.data(Qt.ItemDataRole.UserRole) == conv_id:
                return item
        return None

    def set_title(self, conv_id: str, title: str) -> None:
        item = self.item_for(conv_id)
        if item is not None and item.text() != title:
            self.list.blockSignals(True)
            item.setText(title)
            self.list.blockSignals(False)

    def remove(self, conv_id: str) -> None:
        item = self.item_for(conv_id)
        if item is not None:
            self.list.takeItem(self.list.row(item))

    def move_to_top(self, conv_id: str, keep_current: bool) -> None:
        item = self.item_for(conv_id)
        if item is None or self.list.row(item) == 0:
            return
        self.list.blockSignals(True)
        taken = self.list.takeItem(self.list.row(item))
        self.list.insertItem(0, taken)
        if keep_current:
            self.list.setCurrentItem(taken)
        self.list.blockSignals(False)

    # --- search -------------------------------------------------------------------------------
    def focus_search(self) -> None:
        self.search_edit.setFocus()
        self.search_edit.selectAll()

    def keyPressEvent(self, ev) -> None:  # noqa: N802 - Qt name
        if ev.key() == Qt.Key.Key_Escape and self.search_edit.text():
            self.search_edit.clear()
            return
        super().keyPressEvent(ev)

    def _on_text(self, text: str) -> None:
        if text.strip():
            self._search_timer.start()
        else:
            self.run_search()  # cleared: the list comes back at once

    def run_search(self) -> None:
        self._search_timer.stop()
        query = self.search_edit.text()
        if not query.strip():
            self.stack.setCurrentIndex(0)
            return
        hits = list(self._search(query))
        self.results.clear()
        for title, hit in hits:
            where = "title" if not hit.message_id else ("You" if hit.role == "user"
                                                        else "Assistant")
            item = QListWidgetItem(f"{title} · {where}\n{hit.snippet}")
            item.setData(HIT_ROLE, (hit.conv_id, hit.message_id or ""))
            item.setToolTip(hit.snippet)
            self.results.addItem(item)
        self.result_count.setText(f"{len(hits)} match{'es' if len(hits) != 1 else ''}")
        self.stack.setCurrentIndex(1)

    def _activate_first(self) -> None:
        self.run_search()
        if self.stack.currentIndex() == 1 and self.results.count():
            self._on_hit(self.results.item(0))

    def _on_hit(self, item: QListWidgetItem) -> None:
        conv_id, message_id = item.data(HIT_ROLE)
        self.jump.emit(conv_id, message_id)
