"""The catalog's rows (the engine's JSON, engine_proc/catalog/cli.py) as a Qt table model:
one row per model, unsupported ones greyed with the engine's reason as their tooltip and in the
last column; the estimate's fit label coloured like LM Studio's."""

from __future__ import annotations

from PySide6.QtCore import QAbstractTableModel, QModelIndex, Qt
from PySide6.QtGui import QColor

from ui.units import human_bytes

COLUMNS = ("Name", "Fit", "Memory at context", "Params", "Quant", "Size", "Context",
           "KV / token", "Architecture", "Format", "Store", "Status")  # fmt: skip
FIT_COLORS = {"fits": "#5fbf6f", "tight": "#e0b040", "won't fit": "#e06060"}
GREY = QColor("#808080")
SORT_ROLE = Qt.ItemDataRole.UserRole + 1
PATH_ROLE = Qt.ItemDataRole.UserRole


def params_text(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


class CatalogModel(QAbstractTableModel):
    def __init__(self, parent=None) -> None:
        super().__init__(parent)
        self.rows: list[dict] = []

    def set_rows(self, rows: list[dict]) -> None:
        self.beginResetModel()
        self.rows = list(rows)
        self.endResetModel()

    def rowCount(self, parent: QModelIndex = QModelIndex()) -> int:  # noqa: N802, B008
        return 0 if parent.isValid() else len(self.rows)

    def columnCount(self, parent: QModelIndex = QModelIndex()) -> int:  # noqa: N802, B008
        return 0 if parent.isValid() else len(COLUMNS)

    def headerData(self, section, orientation, role=Qt.ItemDataRole.DisplayRole):  # noqa: N802
        if orientation == Qt.Orientation.Horizontal and role == Qt.ItemDataRole.DisplayRole:
            return COLUMNS[section]
        return None

    def flags(self, index: QModelIndex) -> Qt.ItemFlag:
        base = Qt.ItemFlag.ItemIsSelectable
        if index.isValid() and self.rows[index.row()]["supported"]:
            return base | Qt.ItemFlag.ItemIsEnabled
        return base  # greyed out, still selectable for its tooltip

    def data(self, index: QModelIndex, role: int = Qt.ItemDataRole.DisplayRole):
        if not index.isValid():
            return None
        row, col = self.rows[index.row()], index.column()
        est = row.get("estimate") or {}
        if role == Qt.ItemDataRole.DisplayRole:
            return self.text(row, est, col)
        if role == SORT_ROLE:
            numbers = {
                "Params": row["params"],
                "Size": row["file_size"],
                "Context": row["context_length"],
                "KV / token": est.get("kv_bytes_per_token", -1),
                "Memory at context": est.get("total_bytes", -1),
            }
            return numbers.get(COLUMNS[col], self.text(row, est, col).lower())  # fmt: skip
        if role == PATH_ROLE:
            return row["path"]
        if role == Qt.ItemDataRole.ToolTipRole:
            if not row["supported"]:
                return f"The engine cannot run this model: {row['reason']}"
            return self.tooltip(row, est)
        if role == Qt.ItemDataRole.ForegroundRole:
            if not row["supported"]:
                return GREY
            if COLUMNS[col] == "Fit" and est.get("fit") in FIT_COLORS:
                return QColor(FIT_COLORS[est["fit"]])
        return None

    @staticmethod
    def text(row: dict, est: dict, col: int) -> str:
        name = COLUMNS[col]
        if name == "Fit":
            return est.get("fit", "") if est else "unsupported"
        if name == "Memory at context":
            return human_bytes(est["total_bytes"]) if est else ""
        if name == "KV / token":
            return human_bytes(est["kv_bytes_per_token"]) if est else ""
        if name == "Params":
            return params_text(row["params"])
        if name == "Size":
            return human_bytes(row["file_size"])
        if name == "Context":
            return f"{row['context_length']:,}" if row["context_length"] else "?"
        if name == "Status":
            return "supported" if row["supported"] else row["reason"]
        key = {"Name": "name", "Quant": "quantization", "Architecture": "architecture",
               "Format": "format", "Store": "store"}[name]  # fmt: skip
        return str(row[key] or "?")

    @staticmethod
    def tooltip(row: dict, est: dict) -> str:
        if not est:
            return row["path"]
        lines = [row["path"],
                 f"weights {human_bytes(est['weights_bytes'])} ({est['dtype']}) + KV "
                 f"{human_bytes(est['kv_bytes'])} for {est['context']:,} tokens "
                 f"({est['kv_cache_dtype']}, {est['kv_blocks']} blocks of "
                 f"{human_bytes(est['block_bytes'])}"
                 + (", sliding-window layers keep only their window" if est["hybrid"] else "")
                 + ")",
                 f"free memory now {human_bytes(est['available_bytes'])}"]  # fmt: skip
        if est.get("note"):
            lines.append(est["note"])
        return "\n".join(lines)
