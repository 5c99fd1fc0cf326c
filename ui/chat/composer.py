"""Where a message is written: the input box (Enter sends, Shift+Enter a new line), its
attachments (dropped on the box or picked with Attach…), Send / Stop / Regenerate, and the notice
line above them. The panel decides what the buttons do."""

from __future__ import annotations

from PySide6.QtCore import QEvent, QObject, Qt
from PySide6.QtGui import QKeyEvent
from PySide6.QtWidgets import (
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from ui import theme
from ui.chat.attachment_bar import AttachmentBar, accept_file_drops


class _EnterFilter(QObject):
    """Enter sends, Shift+Enter inserts a newline."""

    def __init__(self, send) -> None:
        super().__init__()
        self._send = send

    def eventFilter(self, obj: QObject, ev: QEvent) -> bool:  # noqa: N802 - Qt name
        if ev.type() == QEvent.Type.KeyPress and isinstance(ev, QKeyEvent):
            if ev.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter) and not (
                ev.modifiers() & Qt.KeyboardModifier.ShiftModifier
            ):
                self._send()
                return True
        return False


class Composer(QWidget):
    def __init__(self, send, stop, regenerate, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.input = QPlainTextEdit()
        self.input.setPlaceholderText("Message (Enter sends, Shift+Enter new line)")
        self.input.setMaximumHeight(80)
        self._enter = _EnterFilter(send)  # Qt does not own event filters
        self.input.installEventFilter(self._enter)
        self.send_btn = QPushButton("Send")
        self.send_btn.clicked.connect(send)
        self.stop_btn = QPushButton("Stop")
        self.stop_btn.clicked.connect(stop)
        self.regen_btn = QPushButton("Regenerate")
        self.regen_btn.clicked.connect(regenerate)
        self.attach_bar = AttachmentBar()
        self._drops = accept_file_drops(self.input, self.attach_bar.add_paths)
        self.notice = QLabel()
        self.notice.setWordWrap(True)
        self.notice.setStyleSheet(f"color: {theme.MUTED};")
        buttons = QVBoxLayout()
        for b in (self.send_btn, self.stop_btn, self.regen_btn):
            buttons.addWidget(b)
        row = QHBoxLayout()
        row.addWidget(self.input, 1)
        row.addLayout(buttons)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addWidget(self.notice)
        lay.addWidget(self.attach_bar)
        lay.addLayout(row)

    def set_text(self, text: str, quiet: bool = False) -> None:
        """Replace the box's text; `quiet` does not count as the user typing (no draft save)."""
        self.input.blockSignals(quiet)
        self.input.setPlainText(text)
        self.input.blockSignals(False)

    def focus(self) -> None:
        self.input.setFocus()
        cursor = self.input.textCursor()
        cursor.movePosition(cursor.MoveOperation.End)
        self.input.setTextCursor(cursor)

    def set_state(self, ready: bool, busy: bool, can_regenerate: bool) -> None:
        self.send_btn.setEnabled(ready and not busy)
        self.stop_btn.setEnabled(busy)
        self.regen_btn.setEnabled(ready and not busy and can_regenerate)
