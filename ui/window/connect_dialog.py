"""*Engine → Connect to server…*: the URL of a vLLM, SGLang, llama.cpp or KVScope server (from a
remembered list) and an optional API key. The URLs are remembered, the key never is."""

from __future__ import annotations

from PySide6.QtWidgets import (
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QFormLayout,
    QLabel,
    QLineEdit,
    QVBoxLayout,
    QWidget,
)

from app.remote.probe import normalize_url

RECENT_KEY = "remote/recent"
MAX_RECENT = 10


def recent_urls(settings) -> list[str]:
    raw = settings.value(RECENT_KEY)
    if raw is None:
        return []
    items = [raw] if isinstance(raw, str) else list(raw)  # INI files give a str for one item
    out: list[str] = []
    for u in items:
        try:
            u = normalize_url(str(u))
        except ValueError:
            continue  # a hand-edited settings file must not break the dialog
        if u not in out:
            out.append(u)
    return out[:MAX_RECENT]


def remember_url(settings, url: str) -> None:
    urls = [url] + [u for u in recent_urls(settings) if u != url]
    settings.setValue(RECENT_KEY, urls[:MAX_RECENT])


class ConnectDialog(QDialog):
    def __init__(self, recent: list[str], parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Connect to server")
        self.setMinimumWidth(460)
        self.url = QComboBox()
        self.url.setEditable(True)
        self.url.addItems(recent)
        self.url.setCurrentText(recent[0] if recent else "http://127.0.0.1:8000")
        self.url.lineEdit().setPlaceholderText("http://HOST:PORT")
        self.key = QLineEdit()
        self.key.setEchoMode(QLineEdit.EchoMode.Password)
        self.key.setPlaceholderText("none")
        self.error = QLabel()
        self.error.setStyleSheet("color: #ff8a80;")
        self.error.setWordWrap(True)
        self.error.setVisible(False)
        note = QLabel(
            "vLLM, SGLang, llama.cpp's server (with --metrics) or <code>kvscope serve</code>. "
            "The window chats through <code>/v1/chat/completions</code> and draws "
            "<code>/metrics</code>; a KVScope server also streams its per-block telemetry. The "
            "key is sent as <code>Authorization: Bearer KEY</code> and is not remembered.")
        note.setWordWrap(True)
        form = QFormLayout()
        form.addRow("Server URL", self.url)
        form.addRow("API key", self.key)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok
                                   | QDialogButtonBox.StandardButton.Cancel)
        buttons.button(QDialogButtonBox.StandardButton.Ok).setText("Connect")
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        lay = QVBoxLayout(self)
        lay.addLayout(form)
        lay.addWidget(self.error)
        lay.addWidget(note)
        lay.addWidget(buttons)

    def accept(self) -> None:
        try:
            normalize_url(self.url.currentText())
        except ValueError as exc:  # stay open and say what is wrong
            self.error.setText(str(exc))
            self.error.setVisible(True)
            return
        super().accept()

    def values(self) -> tuple[str, str | None]:
        return normalize_url(self.url.currentText()), (self.key.text().strip() or None)
