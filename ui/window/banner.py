"""The banner above the window's panes when the engine fails or stops answering: what happened,
the last lines of its log (behind *Show log*), and *Restart engine* (*Reconnect* for a server)."""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QPlainTextEdit, QPushButton, QVBoxLayout

from ui import theme


class EngineBanner(QFrame):
    def __init__(self, on_restart: Callable[[], None]) -> None:
        super().__init__()
        self.setObjectName("banner")
        self.setStyleSheet("QFrame#banner { background: #4a1f24; border-radius: 4px; }")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 6, 8, 6)
        row = QHBoxLayout()
        self.text = QLabel()
        self.text.setWordWrap(True)
        self.text.setStyleSheet("color: #ffd6d6; font-weight: bold;")
        self.restart_btn = QPushButton("Restart engine")
        self.restart_btn.clicked.connect(on_restart)
        self.log_btn = QPushButton("Show log")
        self.log_btn.setCheckable(True)
        row.addWidget(self.text, 1)
        row.addWidget(self.log_btn)
        row.addWidget(self.restart_btn)
        layout.addLayout(row)
        self.log = QPlainTextEdit()
        self.log.setReadOnly(True)
        self.log.setFont(theme.mono_font(8))
        self.log.setMaximumHeight(160)
        self.log.setVisible(False)
        self.log_btn.toggled.connect(self.log.setVisible)
        layout.addWidget(self.log)
        self.setVisible(False)
