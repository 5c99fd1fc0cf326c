"""The KV panel for servers without per-block telemetry (vLLM, SGLang, llama.cpp's server): an
aggregate view, labelled as one. Each data-parallel / tensor-parallel rank gets a bar of its KV
cache usage, with what that means in blocks when the server says how many it has (vLLM's
`cache_config_info`) or in tokens (SGLang's `max_total_num_tokens`); a table breaks running,
waiting, usage, throughput and hit rate down per rank (the multi-GPU view). Nothing here claims
to know which blocks hold what: only a KVScope server reports that (its block map replaces this
panel).
"""

from __future__ import annotations

import math

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QAbstractItemView,
    QGridLayout,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QProgressBar,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.remote.probe import KIND_NAMES
from app.remote.samples import MetricSample, RankSample
from ui import theme
from ui.remote.charts import NOT_REPORTED, _num

RANK_COLUMNS = ("rank", "run", "wait", "KV", "prompt/s", "gen/s", "hit")
RANK_TIPS = ("data-parallel / tensor-parallel rank", "running requests", "waiting requests",
             "KV cache usage", "prompt tokens per second", "generated tokens per second",
             "prefix-cache hit rate (hits over queries, in tokens)")
BAR_STEPS = 1000


def rank_label(rank: str) -> str:
    """'engine=1' -> 'engine 1'; 'dp_rank=0,tp_rank=1,pp_rank=0' -> 'dp 0 · tp 1 · pp 0';
    '' (a server without rank labels) -> 'all'."""
    if not rank:
        return "all"
    parts = []
    for kv in rank.split(","):
        k, _, v = kv.partition("=")
        parts.append(f"{k.removesuffix('_rank')} {v}")
    return " · ".join(parts)


def _pct(v: float | None) -> str:
    return "—" if v is None or not math.isfinite(v) else f"{v * 100:.0f}%"


def _rate(v: float | None) -> str:
    return _num(v, False)


def _count(v: float | None) -> str:
    return "—" if v is None else f"{v:,.0f}"


def usage_detail(usage: float | None, s: MetricSample) -> str:
    """'25% ≈ 6,750 of 27,000 blocks' (or tokens, or just the share when the pool's size is
    not reported)."""
    if usage is None:
        return "—"
    if s.num_blocks:
        return f"{_pct(usage)} ≈ {usage * s.num_blocks:,.0f} of {s.num_blocks:,} blocks"
    if s.capacity_tokens:
        return (f"{_pct(usage)} ≈ {usage * s.capacity_tokens:,.0f} of "
                f"{s.capacity_tokens:,.0f} tokens")
    return f"{_pct(usage)} (the pool's size is not reported)"


class KvAggregateWidget(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.sample: MetricSample | None = None
        self._dirty = False
        self._ranks: list[str] = []
        self.header = QLabel()
        self.header.setWordWrap(True)
        self.header.setTextFormat(Qt.TextFormat.RichText)
        self.total = QLabel()
        self.total.setStyleSheet("font-size: 11pt; font-weight: bold;")
        self.pool = QLabel()
        self.pool.setStyleSheet(f"color: {theme.MUTED};")
        self.pool.setWordWrap(True)
        self.bars_box = QWidget()
        self.bars = QGridLayout(self.bars_box)
        self.bars.setContentsMargins(0, 0, 0, 0)
        self.bars.setColumnStretch(1, 1)
        self.rows: list[tuple[QLabel, QProgressBar, QLabel]] = []

        left = QWidget()
        ll = QVBoxLayout(left)
        ll.setContentsMargins(4, 4, 4, 4)
        ll.addWidget(self.header)
        ll.addWidget(self.total)
        ll.addWidget(self.bars_box)
        ll.addWidget(self.pool)
        ll.addStretch(1)

        self.table = QTableWidget(0, len(RANK_COLUMNS))
        self.table.setHorizontalHeaderLabels(list(RANK_COLUMNS))
        for i, tip in enumerate(RANK_TIPS):
            self.table.horizontalHeaderItem(i).setToolTip(tip + " (n/r: not reported)")
        self.table.verticalHeader().setVisible(False)
        self.table.verticalHeader().setDefaultSectionSize(20)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.NoSelection)
        hdr = self.table.horizontalHeader()
        # a handful of rows that change twice a second: fitting them to their text is cheap
        hdr.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        hdr.setStretchLastSection(True)
        self.table.setToolTip("per data-parallel / tensor-parallel rank, as the server labels "
                              "its metrics (vLLM: engine; SGLang: dp_rank, tp_rank, pp_rank)")

        split = QSplitter(Qt.Orientation.Horizontal)
        split.addWidget(left)
        split.addWidget(self.table)
        split.setStretchFactor(0, 1)
        split.setStretchFactor(1, 1)
        split.setSizes([480, 420])
        lay = QHBoxLayout(self)
        lay.setContentsMargins(2, 2, 2, 2)
        lay.addWidget(split)
        self.set_server("unknown")

    def set_server(self, kind: str) -> None:
        name = KIND_NAMES.get(kind, kind)
        self.header.setText(
            f"<b>Aggregate KV view</b> — {name} reports how full its KV cache is, not which "
            "blocks hold what: the bars are usage × pool size, not a block map. "
            f'<span style="color:{theme.MUTED}">(A KVScope server shows every block.)</span>')

    def set_sample(self, s: MetricSample) -> None:
        """Store the latest sample; drawing happens in `redraw` (the window's timer)."""
        self.sample = s
        self._dirty = True

    def clear(self) -> None:
        self.sample = None
        self._set_rank_rows([])
        self.table.setRowCount(0)
        self.total.setText("")
        self.pool.setText("")

    def redraw(self, force: bool = False) -> None:
        s = self.sample
        if s is None or not (self._dirty or force):
            return
        self._dirty = False
        if not s.reported("kv_usage"):
            self.total.setText(f"KV cache usage: {NOT_REPORTED}")
            self._set_rank_rows([])
        else:
            ranks = sorted(r for r, v in s.ranks.items() if v.kv_usage is not None)
            n = len(ranks)
            self.total.setText(f"KV cache usage {_pct(s.kv_usage)}"
                               + (f" (mean of {n} ranks)" if n > 1 else ""))
            self._set_rank_rows(ranks)
            for (_name, bar, detail), rank in zip(self.rows, ranks, strict=True):
                u = s.ranks[rank].kv_usage
                bar.setValue(round((u or 0.0) * BAR_STEPS))
                detail.setText(usage_detail(u, s))
        self.pool.setText(self._pool_text(s))
        self._fill_table(s)

    @staticmethod
    def _pool_text(s: MetricSample) -> str:
        if s.num_blocks:
            bs = f" × {s.block_size} tokens" if s.block_size else ""
            return f"pool: {s.num_blocks:,} blocks{bs} per rank (from cache_config_info)"
        if s.capacity_tokens:
            return f"pool: {s.capacity_tokens:,.0f} tokens per rank (max_total_num_tokens)"
        return "pool size: not reported by this server"

    def _set_rank_rows(self, ranks: list[str]) -> None:
        if ranks == self._ranks:
            return
        for widgets in self.rows:
            for w in widgets:
                self.bars.removeWidget(w)
                w.deleteLater()
        self.rows = []
        for i, rank in enumerate(ranks):
            name = QLabel(rank_label(rank))
            bar = QProgressBar()
            bar.setRange(0, BAR_STEPS)
            bar.setTextVisible(False)
            bar.setMaximumHeight(14)
            detail = QLabel()
            self.bars.addWidget(name, i, 0)
            self.bars.addWidget(bar, i, 1)
            self.bars.addWidget(detail, i, 2)
            self.rows.append((name, bar, detail))
        self._ranks = list(ranks)

    def _fill_table(self, s: MetricSample) -> None:
        miss = set(s.missing)

        def cell(name: str, text: str) -> str:
            return "n/r" if name in miss else text

        rows = []
        for rank in sorted(s.ranks):
            r: RankSample = s.ranks[rank]
            rows.append((rank_label(rank), cell("running", _count(r.running)),
                         cell("waiting", _count(r.waiting)), cell("kv_usage", _pct(r.kv_usage)),
                         cell("prompt_tokens", _rate(r.prompt_tps)),
                         cell("generation_tokens", _rate(r.gen_tps)),
                         "n/r" if miss & {"prefix_queries", "prefix_hits"} else _pct(r.hit_rate)))
        if self.table.rowCount() != len(rows):
            self.table.setRowCount(len(rows))
        for i, vals in enumerate(rows):
            for j, v in enumerate(vals):
                item = self.table.item(i, j)
                if item is None:
                    item = QTableWidgetItem()
                    self.table.setItem(i, j, item)
                if item.text() != v:
                    item.setText(v)
                    item.setToolTip(NOT_REPORTED if v == "n/r" else "")

    def rank_texts(self) -> list[tuple[str, str]]:
        """(rank label, detail) of each bar (tests)."""
        return [(name.text(), detail.text()) for name, _bar, detail in self.rows]

    def table_rows(self) -> list[tuple[str, ...]]:
        t = self.table
        return [tuple(t.item(i, j).text() for j in range(t.columnCount()))
                for i in range(t.rowCount())]
