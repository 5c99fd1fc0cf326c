"""The window following a server's KV events in vLLM's format (`--kv-events tcp://HOST:5557
[--kv-events-replay tcp://HOST:5558]` with `--connect http://HOST:PORT`, or the connect
dialog's fields): a `KvEventsLink` worker subscribes, a `RemoteTreeFeed` applies the batches on
this part's timer and lays the tree out off the GUI thread, and the *Prefix tree* tab draws it,
coloured by medium, its hover naming the holders and the tokens as text (`Detokenizer`, the
server's /detokenize). For a server without per-block telemetry (vLLM, SGLang) the KV area then
shows the tabs, the prefix tree chosen and *Blocks* hidden, instead of the aggregate panel.
"""

from __future__ import annotations

import collections
import time

from PySide6.QtCore import QObject, QTimer

from app.remote.probe import ServerInfo
from ipc.vllm_events.sequencer import SeqStats
from ui.kv.prefix_tree import sampled_note
from ui.kv.prefix_tree_layout import DISK_ONLY, HOST_ONLY, TreeLayout
from ui.remote.detokenizer import Detokenizer
from ui.remote.kv_events_link import KvEventsLink
from ui.remote.remote_tree import RemoteTreeFeed
from ui.remote.tree_hover import describe_block
from ui.window.host import WindowHost

PUMP_MS = 30  # how often the GUI applies what arrived (8 ms of it at most each time)
NOTE_EVERY = 0.5  # s between refreshes of the note above the tree


class KvEventsWatch(QObject):
    def __init__(self, window: WindowHost) -> None:
        super().__init__(window)
        self.w = window
        self.link: KvEventsLink | None = None
        self.feed: RemoteTreeFeed | None = None
        self.detokenizer: Detokenizer | None = None
        self.timer = QTimer(self)
        self.timer.setInterval(PUMP_MS)
        self.timer.timeout.connect(self._tick)
        self._last_note = 0.0

    @property
    def active(self) -> bool:
        return self.link is not None

    def start(self) -> None:
        """Subscribe to the source's publisher, when it names one (a server over HTTP)."""
        self.stop()
        w = self.w
        src = w.source.kv_events
        if src is None or not w.source.is_remote:
            return
        self.link = KvEventsLink([src])
        self.feed = RemoteTreeFeed(self.link, parent=self)
        self.feed.layout_ready.connect(self._on_layout)
        self.detokenizer = Detokenizer(w.source.connect or "", w.source.api_key, parent=self)
        w.prefix_tree.use_remote(self._describe, f"waiting for KV events from {src.endpoint}")
        self.link.start()
        self.timer.start()
        self.sync_wanted()

    def stop(self) -> None:
        self.timer.stop()
        if self.link is not None:
            self.link.stop(timeout=1.0)
        for part in (self.feed, self.detokenizer):
            if part is not None:
                part.close()
        self.link = self.feed = self.detokenizer = None
        w = self.w
        w.kv_tabs.setTabVisible(w.kv_tabs.indexOf(w.block_map), True)
        w.prefix_tree.use_engine()

    def on_connected(self, info: ServerInfo) -> None:
        """The server answered: show its tree where a server without blocks shows usage."""
        if not self.active or info.disaggregated:
            return
        w = self.w
        assert self.detokenizer is not None
        self.detokenizer.model = info.model or None
        if not info.per_block:
            w.kv_stack.setCurrentWidget(w.kv_tabs)
            w.kv_tabs.setTabVisible(w.kv_tabs.indexOf(w.block_map), False)
            w.kv_tabs.setCurrentWidget(w.prefix_tree)
        self.sync_wanted()

    def sync_wanted(self) -> None:
        """Lay the tree out only while its tab is shown."""
        if self.feed is not None:
            w = self.w
            self.feed.wanted = (w.kv_stack.currentWidget() is w.kv_tabs
                                and w.kv_tabs.currentWidget() is w.prefix_tree)  # fmt: skip

    def stats(self) -> dict[str, SeqStats]:
        return self.link.stats() if self.link is not None else {}

    # --- the timer --------------------------------------------------------------------------
    def _tick(self) -> None:
        feed = self.feed
        if feed is None:
            return
        t0 = time.perf_counter()
        feed.pump()
        self.w.perf.setdefault("kv events", _deque()).append(time.perf_counter() - t0)
        now = time.monotonic()
        if feed.layout is not None and now - self._last_note > NOTE_EVERY:
            self._last_note = now
            self.w.prefix_tree.note.setText(self.note(feed.layout))

    def _on_layout(self, layout: TreeLayout) -> None:
        if self.sender() is not self.feed:
            return
        t0 = time.perf_counter()
        self.w.prefix_tree.set_layout(layout, note=self.note(layout))
        self.w.perf.setdefault("prefix tree", _deque()).append(time.perf_counter() - t0)

    def note(self, lay: TreeLayout) -> str:
        """Above the tree: what it holds, from where, and what went wrong on the way."""
        host, disk = lay.count(HOST_ONLY), lay.count(DISK_ONLY)
        tiers = f" ({host:,} in CPU memory only, {disk:,} on storage only)" if host + disk else ""
        parts = [f"{lay.num_blocks:,} blocks{tiers} · {lay.num_rows:,} branches · "
                 f"{lay.num_roots:,} roots" + sampled_note(lay)]
        for name, st in self.stats().items():
            parts.append(f"{name}: " + source_note(st, self.link.errors.get(name) if self.link
                                                   else None))  # fmt: skip
        behind = self.feed.behind if self.feed is not None else 0
        if behind:
            parts.append(f"applying ({behind:,} chunks to go)")
        return " · ".join(parts)

    # --- the hover --------------------------------------------------------------------------
    def _describe(self, lay: TreeLayout, i: int) -> str:
        feed, detok = self.feed, self.detokenizer
        holders = feed.tree.sources_holding if feed is not None else (lambda h: frozenset())
        text_of = detok.text if detok is not None else (lambda t: None)
        return describe_block(lay, i, holders, text_of)


def source_note(st: SeqStats, error: str | None) -> str:
    if error:
        return f"cannot subscribe ({error})"
    if st.last_seq is None:
        return "no batch yet"
    out = [f"batch {st.last_seq:,}"]
    if st.first_seq:
        out.append(f"replay began at batch {st.first_seq:,}: earlier blocks unknown")
    for count, what in ((st.lost, "batches lost"), (st.garbage, "garbage frames skipped"),
                        (st.restarts, "publisher restarts")):
        if count:
            out.append(f"{count:,} {what}")
    return ", ".join(out)


def _deque() -> collections.deque[float]:
    return collections.deque(maxlen=10_000)
