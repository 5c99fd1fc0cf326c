"""The fleet panel (`--fleet`, *Engine → Connect to a fleet…*): a table with one row per replica
(ui/fleet/table.py: its /metrics figures, the blocks its KV events say it holds), one prefix
tree for the whole fleet (a `FleetTree` with one source per replica's publisher, each block
marked by the replicas holding it: ui/fleet/tree_marks.py) and a route box: a prompt tokenized
by every replica's /tokenize, scored per replica as the longest cached prefix in tokens, the
replica a KV-aware router would pick highlighted (ui/fleet/routing.py).

HTTP runs on the `FleetScraper`'s thread and ZeroMQ on the `KvEventsLink`'s; the GUI thread
only applies decoded batches on its timer, within a time budget (`RemoteTreeFeed`)."""

from __future__ import annotations

import logging
import time

from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import (
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QSplitter,
    QVBoxLayout,
    QWidget,
)

from app.remote.fleet import Replica
from app.remote.samples import MetricSample
from ui.fleet.routing import Score, choose, score
from ui.fleet.scraper import FleetScraper
from ui.fleet.table import FleetTable
from ui.fleet.tree_marks import HOLDERS_LEGEND, layout_by_replica
from ui.kv.prefix_tree import PrefixTreePanel
from ui.kv.prefix_tree_layout import TreeLayout
from ui.remote.kv_events_link import KvEventsLink
from ui.remote.remote_tree import RemoteTreeFeed
from ui.remote.tree_hover import describe_block
from ui.window.kv_events import source_note

log = logging.getLogger(__name__)

PUMP_MS = 30  # the GUI applies what arrived this often (8 ms of it at most each time)
REFRESH_EVERY = 0.5  # s between refreshes of the blocks column, the scores and the note


class FleetPanel(QWidget):
    def __init__(self, replicas: list[Replica], *, api_key: str | None = None,
                 scraper_options: dict | None = None,
                 parent: QWidget | None = None) -> None:  # fmt: skip
        super().__init__(parent)
        self.setWindowTitle(f"KVScope — fleet of {len(replicas)}")
        self.replicas = list(replicas)
        self.samples: list[MetricSample | None] = [None] * len(replicas)
        self.scraper = FleetScraper(replicas, api_key=api_key, parent=self,
                                    **(scraper_options or {}))  # fmt: skip
        self.scraper.sample.connect(self._on_sample)
        self.scraper.problem.connect(self._on_problem)
        self.scraper.tokenized.connect(self._on_tokenized)
        sources = [r.kv_events for r in replicas if r.kv_events is not None]
        self.link = KvEventsLink(sources) if sources else None
        self.feed: RemoteTreeFeed | None = None
        # publisher endpoint (the tree's source id) -> the replica's label
        self.labels = {r.kv_events.name: r.label for r in replicas if r.kv_events is not None}
        self.table = FleetTable([r.label for r in replicas])
        self.tree_panel = PrefixTreePanel()
        self.prompt = QLineEdit()
        self.prompt.setPlaceholderText("type a prompt: which replica holds the longest prefix?")
        self.route_button = QPushButton("Route")
        self.route_note = QLabel()
        self.route_note.setWordWrap(True)
        self._ask = 0
        self._tokens: dict[int, tuple[list[int] | None, str]] = {}  # replica -> tokens, why not
        self.scores: list[Score] = []
        self.chosen: int | None = None
        self._last_refresh = 0.0
        self.timer = QTimer(self)
        self.timer.setInterval(PUMP_MS)
        self.timer.timeout.connect(self._tick)
        self._build()

    def _build(self) -> None:
        self.prompt.returnPressed.connect(self.route)
        self.route_button.clicked.connect(self.route)
        box = QHBoxLayout()
        box.addWidget(QLabel("Route a prompt"))
        box.addWidget(self.prompt, 1)
        box.addWidget(self.route_button)
        top = QWidget()
        top_lay = QVBoxLayout(top)
        top_lay.addWidget(self.table)
        top_lay.addLayout(box)
        top_lay.addWidget(self.route_note)
        split = QSplitter(Qt.Orientation.Vertical)
        split.addWidget(top)
        split.addWidget(self.tree_panel)
        split.setStretchFactor(1, 3)  # the tree gets the room; the table needs a few rows
        lay = QVBoxLayout(self)
        lay.addWidget(split)
        waiting = ("waiting for KV events" if self.link is not None
                   else "no KV events endpoint given: no prefix tree")  # fmt: skip
        self.tree_panel.use_remote(self._describe, waiting, HOLDERS_LEGEND)

    # --- life -------------------------------------------------------------------------------
    def start(self) -> None:
        self.scraper.start()
        if self.link is not None:
            n = len(self.labels)
            self.feed = RemoteTreeFeed(self.link, parent=self,
                                       layout_fn=lambda s: layout_by_replica(s, self.labels, n))
            self.feed.wanted = True
            self.feed.layout_ready.connect(self._on_layout)
            self.link.start()
        self.timer.start()

    def stop(self) -> None:
        self.timer.stop()
        self.scraper.stop()
        if self.link is not None:
            self.link.stop(timeout=1.0)
        if self.feed is not None:
            self.feed.close()

    def closeEvent(self, event) -> None:  # noqa: N802 - Qt's name
        self.stop()
        super().closeEvent(event)

    # --- /metrics ---------------------------------------------------------------------------
    def _on_sample(self, i: int, sample: MetricSample) -> None:
        self.samples[i] = sample
        self.table.set_sample(i, sample)

    def _on_problem(self, i: int, why: str) -> None:
        self.table.set_problem(i, why)

    # --- routing ----------------------------------------------------------------------------
    def route(self) -> None:
        """Tokenize the prompt on every replica; the scores follow as the answers come."""
        text = self.prompt.text()
        if not text:
            return
        self._ask += 1
        self._tokens = {}
        self.route_note.setText("tokenizing on every replica…")
        self.scraper.tokenize(self._ask, text)

    def _on_tokenized(self, ask: int, i: int, tokens: list[int] | None, why: str) -> None:
        if ask != self._ask:
            return  # an answer about an older prompt
        self._tokens[i] = (tokens, why)
        self.rescore()

    def rescore(self) -> None:
        if not self._tokens:
            return
        tree = self.feed.tree if self.feed is not None else None
        self.scores = [self._score(tree, i) for i in range(len(self.replicas))]
        self.chosen = choose(self.scores)
        self.table.set_scores(self.scores, self.chosen)
        self.route_note.setText(self._route_text())

    def _score(self, tree, i: int) -> Score:
        if i not in self._tokens:
            return Score(None, why="tokenizing…")
        tokens, why = self._tokens[i]
        src = self.replicas[i].kv_events
        if tree is None or src is None:
            return Score(None, why="no KV events endpoint given")
        bs = tree.block_sizes.get(src.name) or self._metrics_block_size(i)
        return score(tree, src.name, tokens, bs, why)

    def _metrics_block_size(self, i: int) -> int | None:
        s = self.samples[i]  # vLLM's cache_config_info says it before any block is stored
        return s.block_size if s is not None else None

    def _route_text(self) -> str:
        if len(self._tokens) < len(self.replicas):
            return "tokenizing on every replica…"
        if self.chosen is None:
            return ("no replica holds a prefix of this prompt: a KV-aware router falls back "
                    "to its load scorers")
        return (f"a KV-aware router (llm-d's prefix-cache scorer) sends it to "
                f"{self.replicas[self.chosen].label}: {self.scores[self.chosen].tokens:,} "
                f"tokens already cached")

    # --- the tree ---------------------------------------------------------------------------
    def _tick(self) -> None:
        if self.feed is not None:
            self.feed.pump()
        now = time.monotonic()
        if now - self._last_refresh < REFRESH_EVERY:
            return
        self._last_refresh = now
        self.refresh()

    def refresh(self) -> None:
        """The blocks column, the scores (the tree moved on) and the note above the tree."""
        held = self.feed.tree.sources() if self.feed is not None else {}
        for i, r in enumerate(self.replicas):
            self.table.set_blocks(i, held.get(r.kv_events.name, 0) if r.kv_events else None)
        self.rescore()
        if self.feed is not None and self.feed.layout is not None:
            self.tree_panel.note.setText(self.note(self.feed.layout))

    def _on_layout(self, layout: TreeLayout) -> None:
        self.tree_panel.set_layout(layout, note=self.note(layout))
        self.tree_panel.redraw()  # the main window's feed redraws its panels; here, we do

    def note(self, lay: TreeLayout) -> str:
        parts = [f"{lay.num_blocks:,} blocks across the fleet · {lay.num_rows:,} branches"]
        assert self.link is not None
        for name, st in self.link.stats().items():
            parts.append(f"{self.labels.get(name, name)}: "
                         + source_note(st, self.link.errors.get(name)))
        return " · ".join(parts)

    def _describe(self, lay: TreeLayout, i: int) -> str:
        # the layout's media are the replicas' labels (tree_marks): "held by" names replicas
        text = describe_block(lay, i, lambda h: frozenset(), lambda t: None)
        return text.replace("lives in: ", f"held by {len(lay.media[i])} replica(s): ", 1)
