"""*File → Models…*: every model the catalog finds (LM Studio, the Hugging Face cache, Ollama,
llama.cpp's cache, folders added here), what each needs at a chosen context and KV type against
the memory free now, and *Load* to restart the engine on the selected one.

The listing runs in a QProcess (runner.py): changing the context or KV type lists again with the
new estimate; the engine computes it with its own pool sizing."""

from __future__ import annotations

from PySide6.QtCore import QSortFilterProxyModel, Qt, Signal
from PySide6.QtWidgets import (
    QAbstractItemView,
    QComboBox,
    QDialog,
    QFileDialog,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QPushButton,
    QTableView,
    QVBoxLayout,
    QWidget,
)

from app.models.catalog import FOLDERS_KEY, KV_CACHE_DTYPES
from ui.models.runner import CatalogRunner
from ui.models.table import PATH_ROLE, SORT_ROLE, CatalogModel
from ui.units import human_bytes

# (tokens, label); None: each model's own context length
CONTEXT_CHOICES = ((2048, "2K"), (4096, "4K"), (8192, "8K"), (32768, "32K"), (131072, "128K"),
                   (None, "model's own"))  # fmt: skip


class ModelsDialog(QDialog):
    load_requested = Signal(str)  # a model's path

    def __init__(self, settings, parent: QWidget | None = None, kv_cache_dtype: str = "auto",
                 dtype: str = "float32", current: str | None = None,
                 runner: CatalogRunner | None = None) -> None:  # fmt: skip
        super().__init__(parent)
        self.setWindowTitle("Models")
        self.resize(1100, 460)
        self.settings = settings
        self.dtype = dtype
        self.current = current
        self.model = CatalogModel(self)
        proxy = self.proxy = QSortFilterProxyModel(self)
        proxy.setSourceModel(self.model)
        proxy.setSortRole(SORT_ROLE)
        view = self.view = QTableView(self)
        view.setModel(proxy)
        view.setSortingEnabled(True)
        view.sortByColumn(0, Qt.SortOrder.AscendingOrder)
        view.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        view.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        view.verticalHeader().setVisible(False)
        view.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        view.horizontalHeader().setStretchLastSection(True)
        view.doubleClicked.connect(lambda _: self.load_selected())
        self.context = QComboBox(self)
        for tokens, label in CONTEXT_CHOICES:
            self.context.addItem(label, tokens)
        self.context.setCurrentIndex(1)
        self.context.setToolTip("tokens of one conversation the KV estimate is for")
        self.kv_dtype = QComboBox(self)
        for value in KV_CACHE_DTYPES:
            self.kv_dtype.addItem(value, value)
        self.kv_dtype.setCurrentIndex(max(0, self.kv_dtype.findData(kv_cache_dtype)))
        self.kv_dtype.setToolTip("the KV cache's element type (Engine → KV cache)")
        self.status = QLabel("", self)
        self.status.setWordWrap(True)
        self.add_button = QPushButton("Add folder…", self)
        self.refresh_button = QPushButton("Refresh", self)
        self.load_button = QPushButton("Load", self)
        self.load_button.setDefault(True)
        self.load_button.setEnabled(False)
        close = QPushButton("Close", self)
        top = QHBoxLayout()
        top.addWidget(QLabel("Context:"))
        top.addWidget(self.context)
        top.addWidget(QLabel("KV cache:"))
        top.addWidget(self.kv_dtype)
        top.addStretch(1)
        top.addWidget(self.add_button)
        top.addWidget(self.refresh_button)
        bottom = QHBoxLayout()
        bottom.addWidget(self.status, 1)
        bottom.addWidget(self.load_button)
        bottom.addWidget(close)
        layout = QVBoxLayout(self)
        layout.addLayout(top)
        layout.addWidget(view, 1)
        layout.addLayout(bottom)
        self.runner = runner or CatalogRunner(self)
        self.destroyed.connect(self.runner.cancel)
        self.runner.finished.connect(self.show_catalog)
        self.runner.failed.connect(self.show_failure)
        self.context.currentIndexChanged.connect(lambda _: self.refresh())
        self.kv_dtype.currentIndexChanged.connect(lambda _: self.refresh())
        self.add_button.clicked.connect(self.choose_folder)
        self.refresh_button.clicked.connect(self.refresh)
        self.load_button.clicked.connect(self.load_selected)
        close.clicked.connect(self.reject)
        view.selectionModel().selectionChanged.connect(lambda *_: self._update_load())

    # --- folders the user added (remembered) -------------------------------------------------
    def folders(self) -> list[str]:
        value = self.settings.value(FOLDERS_KEY) or []
        return [value] if isinstance(value, str) else [str(v) for v in value]

    def add_folder(self, path: str) -> None:
        folders = self.folders()
        if path and path not in folders:
            self.settings.setValue(FOLDERS_KEY, [*folders, path])
        self.refresh()

    def choose_folder(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Add a folder of models")
        if path:
            self.add_folder(path)

    # --- listing --------------------------------------------------------------------------------
    def refresh(self) -> None:
        self.status.setText("Looking for models…")
        self.refresh_button.setEnabled(False)
        self.runner.run(self.folders(), self.context.currentData(), self.kv_dtype.currentData(),
                        self.dtype)  # fmt: skip

    def show_catalog(self, data: dict) -> None:
        rows = data.get("models", [])
        self.model.set_rows(rows)
        self.refresh_button.setEnabled(True)
        ok = sum(1 for r in rows if r["supported"])
        free = data.get("available_bytes") or 0
        self.status.setText(
            f"{len(rows)} models, {ok} the engine runs; free memory now {human_bytes(free)}"
            if rows else "No models found: add a folder, or download one with LM Studio, Ollama, "
            "llama.cpp (-hf) or the Hugging Face CLI.")  # fmt: skip
        if self.current:
            self.select_path(self.current)
        self._update_load()

    def show_failure(self, why: str) -> None:
        self.refresh_button.setEnabled(True)
        self.status.setText(f"Could not list the models: {why}")

    def select_path(self, path: str) -> bool:
        for r in range(self.proxy.rowCount()):
            index = self.proxy.index(r, 0)
            if index.data(PATH_ROLE) == path:
                self.view.selectRow(r)
                return True
        return False

    def selected_row(self) -> dict | None:
        rows = self.view.selectionModel().selectedRows()
        if not rows:
            return None
        return self.model.rows[self.proxy.mapToSource(rows[0]).row()]

    def _update_load(self) -> None:
        row = self.selected_row()
        self.load_button.setEnabled(bool(row and row["supported"]))
        if row is not None and not row["supported"]:
            self.load_button.setToolTip(row["reason"])
        else:
            self.load_button.setToolTip("restart the engine on this model")

    def load_selected(self) -> None:
        row = self.selected_row()
        if row is None or not row["supported"]:
            return
        self.load_requested.emit(row["path"])
        self.accept()

    def done(self, result: int) -> None:
        self.runner.cancel()
        super().done(result)

    def closeEvent(self, event) -> None:  # noqa: N802 - Qt name
        self.runner.cancel()
        super().closeEvent(event)
