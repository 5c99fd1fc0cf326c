"""The block map's request table: one row per live request with its origin (the client that
sent it: gui, load, http, ...), prompt, prefix hit, output, blocks and constraint; the row of the
highlighted request is selected. Rows are rewritten cell by cell and at most 4 times a second."""

from __future__ import annotations

import time

import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QAbstractItemView, QHeaderView, QTableWidget, QTableWidgetItem

from ui import theme
from ui.kv.constraints import constraint_label, constraint_tooltip
from ui.telemetry import Frame, origin_label

TABLE_COLUMNS = ("request", "origin", "status", "prompt", "hit", "gen", "blocks", "constraint")


class RequestTable(QTableWidget):
    def __init__(self) -> None:
        super().__init__(0, len(TABLE_COLUMNS))
        self._rows: list[tuple[str, ...]] = []
        self._table_time = 0.0
        self._brushes = [pg.mkBrush(c) for c in theme.REQUEST_COLOURS]
        self.setHorizontalHeaderLabels(list(TABLE_COLUMNS))
        self.horizontalHeaderItem(TABLE_COLUMNS.index("origin")).setToolTip(
            "the client that sent it: gui = this window's chats, load = its load generator, "
            "http = the OpenAI-compatible API, otherwise the name the client gave the engine")
        self.horizontalHeaderItem(TABLE_COLUMNS.index("hit")).setToolTip(
            "prompt tokens served by the prefix cache")
        self.horizontalHeaderItem(TABLE_COLUMNS.index("constraint")).setToolTip(
            "what an agent's request carries: a grammar (json, regex, choice, grammar; from "
            "response_format, structured_outputs or a forced tool_choice) and/or tools")
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.verticalHeader().setDefaultSectionSize(20)
        self.verticalHeader().setVisible(False)
        self.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        hdr = self.horizontalHeader()
        # fixed widths: ResizeToContents re-measures every row on every cell change (slow)
        hdr.setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        for i, width in enumerate((40, 56, 46, 36, 36, 44, 64), start=1):
            hdr.setSectionResizeMode(i, QHeaderView.ResizeMode.Fixed)
            hdr.resizeSection(i, width)

    def reset(self) -> None:
        self.setRowCount(0)
        self._rows = []

    def fill(self, f: Frame, slots: dict[str, int], highlight_rid: str | None) -> None:
        """The frame's live requests; `slots`: request id -> its palette slot on the map."""
        reqs = [r for r in f.requests if r.status != "finished"]
        rows = [(r.request_id, origin_label(r.origin, r.request_id), r.status,
                 str(r.num_prompt_tokens), str(r.num_cached_tokens),
                 str(r.num_generated_tokens), str(len(r.live_blocks())), constraint_label(r))
                for r in reqs]
        now = time.monotonic()
        # each QTableWidgetItem.setText re-lays the table out: only changed cells, at most 4 Hz
        if rows == self._rows or (now - self._table_time < 0.25 and
                                  len(rows) == len(self._rows)):
            return
        self._table_time = now
        self.blockSignals(True)
        if len(rows) != len(self._rows):
            self.setRowCount(len(rows))
        for row, vals in enumerate(rows):
            old = self._rows[row] if row < len(self._rows) else None
            for col, v in enumerate(vals):
                if old is not None and old[col] == v and self.item(row, col) is not None:
                    continue
                item = self.item(row, col)
                if item is None:
                    item = QTableWidgetItem()
                    self.setItem(row, col, item)
                item.setText(v)
                if col == len(vals) - 1:
                    item.setToolTip(constraint_tooltip(reqs[row]))
                if col == 0:
                    slot = slots.get(v)
                    if slot is not None:
                        item.setForeground(self._brushes[slot])
        self._rows = rows
        ids = [r[0] for r in rows]
        if highlight_rid in ids:
            self.selectRow(ids.index(highlight_rid))
        else:
            self.clearSelection()
        self.blockSignals(False)
