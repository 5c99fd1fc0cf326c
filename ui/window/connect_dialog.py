"""*Engine → Connect to server…*: the URL of a vLLM, SGLang, llama.cpp or KVScope server (from a
remembered list), an optional API key, and optionally the server's KV events endpoint (vLLM's
and SGLang's `--kv-events-config` publisher) and its replay endpoint, whose events the *Prefix
tree* tab draws. The URLs are remembered, the key and the endpoints are not."""

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

from app.remote.kv_events_source import ENDPOINT_FORMS, KvEventsSource, make_source
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
        self.kv_events = QLineEdit()
        self.kv_events.setPlaceholderText("optional: tcp://HOST:5557")
        self.kv_events.setToolTip("the publisher of --kv-events-config (vLLM, SGLang): the "
                                  f"Prefix tree tab draws its blocks. {ENDPOINT_FORMS}")
        self.kv_replay = QLineEdit()
        self.kv_replay.setPlaceholderText("optional: tcp://HOST:5558")
        self.kv_replay.setToolTip("its replay_endpoint: missed events are asked for again")
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
        form.addRow("KV events endpoint", self.kv_events)
        form.addRow("Replay endpoint", self.kv_replay)
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
            self.kv_events_source()
        except ValueError as exc:  # stay open and say what is wrong
            self.error.setText(str(exc))
            self.error.setVisible(True)
            return
        super().accept()

    def values(self) -> tuple[str, str | None]:
        return normalize_url(self.url.currentText()), (self.key.text().strip() or None)

    def kv_events_source(self) -> KvEventsSource | None:
        """The KV event publisher given (None: none); ValueError naming the field wrong."""
        return make_source(self.kv_events.text(), self.kv_replay.text())
