"""A word-wrapped plain-text label exactly as tall as its text at its own width.

A wrapping QLabel asks its layout for height-for-width, and a scroll area full of them re-lays out
every label's text, at several widths, whenever any one message grows: with 500 messages that cost
~230 ms per streamed token (`python -m ui.chat.bench_stream --plain`). This label gives the layout
a fixed height instead and recomputes it only when its own width, text or font changes, so a
growing message costs the transcript one cheap pass over cached size hints.
"""

from __future__ import annotations

from PySide6.QtCore import QEvent, Qt
from PySide6.QtGui import QResizeEvent
from PySide6.QtWidgets import QLabel, QSizePolicy, QWidget


class FitLabel(QLabel):
    def __init__(self, text: str = "", parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setTextFormat(Qt.TextFormat.PlainText)
        self.setWordWrap(True)
        self.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Fixed)
        self.setText(text)

    def hasHeightForWidth(self) -> bool:  # noqa: N802 - Qt's name
        return False  # QLabel sets it on its size policy at each text change: the layout must not

    def setText(self, text: str) -> None:  # noqa: N802 - QLabel's name
        if text != super().text():
            super().setText(text)
            self._fit()

    def resizeEvent(self, event: QResizeEvent) -> None:  # noqa: N802 - Qt's name
        super().resizeEvent(event)
        if event.size().width() != event.oldSize().width():
            self._fit()

    def changeEvent(self, event: QEvent) -> None:  # noqa: N802 - Qt's name
        super().changeEvent(event)
        if event.type() in (QEvent.Type.FontChange, QEvent.Type.StyleChange):
            self._fit()

    def _fit(self) -> None:
        h = self.heightForWidth(self.width())
        if h >= 0 and (self.minimumHeight(), self.maximumHeight()) != (h, h):
            self.setFixedHeight(h)
