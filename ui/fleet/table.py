"""The fleet's table: one row per replica with its /metrics figures (the same `MetricSample`
the single-server view draws), the blocks its KV events say it holds, and the routing score
of the prompt in the route box; the replica a KV-aware router would choose is highlighted."""

from __future__ import annotations

from PySide6.QtGui import QBrush, QColor
from PySide6.QtWidgets import QAbstractItemView, QHeaderView, QTableWidget, QTableWidgetItem

from app.remote.samples import MetricSample
from ui.fleet.routing import Score

COLUMNS = ("replica", "KV cache", "prefix hits", "running", "waiting", "gen tok/s",
           "blocks held", "route score")  # fmt: skip
REPLICA, KV, HITS, RUNNING, WAITING, GEN, BLOCKS, SCORE = range(len(COLUMNS))
DASH = "—"  # reported, nothing to say yet (no second scrape)
NOT_REPORTED = "n/r"  # the server does not export it
CHOSEN = QColor("#2e7d32")


def percent(v: float | None) -> str:
    return DASH if v is None else f"{100 * v:.1f}%"


def number(v: float | None, digits: int = 0) -> str:
    return DASH if v is None else f"{v:,.{digits}f}"


def sample_cells(s: MetricSample) -> dict[int, str]:
    """The row's /metrics cells; a metric the server does not export says so."""
    cells = {KV: percent(s.kv_usage), HITS: percent(s.hit_rate), RUNNING: number(s.running),
             WAITING: number(s.waiting), GEN: number(s.gen_tps, 1)}  # fmt: skip
    for col, name in ((KV, "kv_usage"), (HITS, "prefix_hits"), (RUNNING, "running"),
                      (WAITING, "waiting"), (GEN, "generation_tokens")):  # fmt: skip
        if not s.reported(name):
            cells[col] = NOT_REPORTED
    return cells


def score_text(s: Score) -> str:
    if s.tokens is None:
        return f"— ({s.why})"
    return f"{s.tokens:,} tokens ({s.blocks} × {s.block_size})"


class FleetTable(QTableWidget):
    def __init__(self, labels: list[str]) -> None:
        super().__init__(len(labels), len(COLUMNS))
        self.setHorizontalHeaderLabels(list(COLUMNS))
        self.verticalHeader().setVisible(False)
        self.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.setSelectionMode(QAbstractItemView.SelectionMode.NoSelection)
        self.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.horizontalHeader().setStretchLastSection(True)
        self.chosen: int | None = None
        for row, label in enumerate(labels):
            for col in range(len(COLUMNS)):
                self.setItem(row, col, QTableWidgetItem(label if col == REPLICA else DASH))

    def text(self, row: int, col: int) -> str:
        return self.item(row, col).text()

    def set_sample(self, row: int, s: MetricSample) -> None:
        for col, text in sample_cells(s).items():
            self.item(row, col).setText(text)

    def set_problem(self, row: int, why: str) -> None:
        self.item(row, REPLICA).setToolTip(why)
        self.item(row, REPLICA).setForeground(QBrush(QColor("#ff8a80")) if why else QBrush())

    def set_blocks(self, row: int, blocks: int | None) -> None:
        self.item(row, BLOCKS).setText("no events" if blocks is None else f"{blocks:,}")

    def set_scores(self, scores: list[Score], chosen: int | None) -> None:
        self.chosen = chosen
        for row, s in enumerate(scores):
            self.item(row, SCORE).setText(score_text(s) + ("  ← router's pick"
                                                            if row == chosen else ""))
            brush = QBrush(CHOSEN) if row == chosen else QBrush()
            for col in range(len(COLUMNS)):
                self.item(row, col).setBackground(brush)
