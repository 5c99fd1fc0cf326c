"""`‹ 2/3 ›` on a message that has siblings: an edit of a user turn or a regenerated reply made a
branch; the arrows switch the transcript to the previous or next one."""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QHBoxLayout, QLabel, QToolButton, QWidget

from ui import theme


class BranchNav(QWidget):
    stepped = Signal(int)  # -1 previous branch, +1 next

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        lay = QHBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.setSpacing(0)
        self.prev_btn = QToolButton(text="‹", autoRaise=True)
        self.next_btn = QToolButton(text="›", autoRaise=True)
        self.prev_btn.setToolTip("previous branch")
        self.next_btn.setToolTip("next branch")
        self.label = QLabel()
        self.label.setStyleSheet(f"color: {theme.MUTED}; font-size: 8pt;")
        self.prev_btn.clicked.connect(lambda: self.stepped.emit(-1))
        self.next_btn.clicked.connect(lambda: self.stepped.emit(1))
        for w in (self.prev_btn, self.label, self.next_btn):
            lay.addWidget(w)
        self.set_position(1, 1)

    def set_position(self, index: int, count: int) -> None:
        """`index` is 1-based; a message without siblings shows nothing."""
        self.label.setText(f"{index}/{count}")
        self.prev_btn.setEnabled(index > 1)
        self.next_btn.setEnabled(index < count)
        self.setVisible(count > 1)
