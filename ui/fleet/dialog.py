"""*Engine → Connect to a fleet…*: one row per replica (or per data-parallel rank: a URL each)
with its server URL, its KV events endpoint and optionally its replay endpoint; an API key for
all of them. Wrong input keeps the dialog open and names the row and the field."""

from __future__ import annotations

from PySide6.QtWidgets import (
    QDialog,
    QDialogButtonBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.remote.fleet import Replica, check_distinct, make_replica

FIELDS = ("Server URL", "KV events endpoint", "Replay endpoint (optional)")


class FleetDialog(QDialog):
    def __init__(self, rows: int = 2, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Connect to a fleet")
        self.setMinimumWidth(720)
        self.rows = QTableWidget(0, len(FIELDS))
        self.rows.setHorizontalHeaderLabels(list(FIELDS))
        self.rows.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Stretch)
        for _ in range(rows):
            self.add_row()
        add, remove = QPushButton("Add replica"), QPushButton("Remove last")
        add.clicked.connect(lambda: self.add_row())
        remove.clicked.connect(self._remove_last)
        self.key = QLineEdit()
        self.key.setEchoMode(QLineEdit.EchoMode.Password)
        self.key.setPlaceholderText("API key for every server: none")
        self.error = QLabel()
        self.error.setStyleSheet("color: #ff8a80;")
        self.error.setWordWrap(True)
        self.error.setVisible(False)
        note = QLabel("One row per vLLM, SGLang or <code>kvscope serve</code> replica (one per "
                      "data-parallel rank: rank r publishes on the events port + r). The "
                      "endpoints are the publishers' <code>--kv-events-config</code> ones, "
                      "with the host to connect to, e.g. <code>tcp://10.0.0.5:5557</code>.")
        note.setWordWrap(True)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok
                                   | QDialogButtonBox.StandardButton.Cancel)  # fmt: skip
        buttons.button(QDialogButtonBox.StandardButton.Ok).setText("Watch the fleet")
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        row_buttons = QHBoxLayout()
        row_buttons.addWidget(add)
        row_buttons.addWidget(remove)
        row_buttons.addStretch(1)
        lay = QVBoxLayout(self)
        for part in (self.rows, row_buttons, self.key, self.error, note, buttons):
            (lay.addLayout if isinstance(part, QHBoxLayout) else lay.addWidget)(part)

    def add_row(self, url: str = "", events: str = "", replay: str = "") -> None:
        row = self.rows.rowCount()
        self.rows.insertRow(row)
        for col, text in enumerate((url, events, replay)):
            self.rows.setItem(row, col, QTableWidgetItem(text))

    def _remove_last(self) -> None:
        if self.rows.rowCount() > 1:
            self.rows.removeRow(self.rows.rowCount() - 1)

    def _cell(self, row: int, col: int) -> str:
        item = self.rows.item(row, col)
        return item.text().strip() if item is not None else ""

    def replicas(self) -> list[Replica]:
        """The rows filled in (blank rows skipped); ValueError naming the row and field."""
        out = []
        for row in range(self.rows.rowCount()):
            url, events, replay = (self._cell(row, c) for c in range(len(FIELDS)))
            if url or events or replay:
                out.append(make_replica(url, events, replay, where=f"row {row + 1}"))
        if not out:
            raise ValueError("give at least one server URL")
        check_distinct(out, "the fleet")
        return out

    def api_key(self) -> str | None:
        return self.key.text().strip() or None

    def accept(self) -> None:
        try:
            self.replicas()
        except ValueError as exc:  # stay open and say what is wrong
            self.error.setText(str(exc))
            self.error.setVisible(True)
            return
        super().accept()
