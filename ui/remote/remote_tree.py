"""A remote server's prefix tree, the GUI thread's side: `pump()`, called from the window's
timer, takes what the KV events link (ui/remote/kv_events_link.py) decoded and applies it to a
`FleetTree` for at most `budget_s` per call, so a replay of 100,000 blocks is spread over many
timer ticks instead of freezing the window; the tree lives on the GUI thread, where the views
and later the fleet panel query it. The layout (ui/kv/prefix_tree_layout.py: ~0.7 s of Python
for 100,000 blocks) runs on a thread of its own over a snapshot (a copy of one dict of immutable
nodes), at most every `layout_every` s and never more than a fifth of the time, and only while
the tab is shown (`wanted`); `layout_ready` brings the result back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from PySide6.QtCore import QObject, Signal

from ipc.vllm_events.fleet_tree import FleetSnapshot, FleetTree
from ipc.vllm_events.media import DEVICE, HOST, top_tier
from ipc.vllm_events.sequencer import Reset
from ui.kv.prefix_tree_layout import DISK_ONLY, HOST_ONLY, IN_POOL, TreeLayout, layout_tree
from ui.remote.kv_events_link import KvEventsLink

log = logging.getLogger(__name__)


def fleet_tier(media: frozenset[str]) -> int:
    """The layout's tier (the panel's colour) of a block from the publishers' media."""
    tier = top_tier(media)
    return IN_POOL if tier == DEVICE else HOST_ONLY if tier == HOST else DISK_ONLY


def layout_fleet(snapshot: FleetSnapshot | FleetTree) -> TreeLayout:
    return layout_tree(snapshot, tier_of=fleet_tier)  # type: ignore[arg-type]


class RemoteTreeFeed(QObject):
    layout_ready = Signal(object)  # TreeLayout, on the GUI thread
    _laid_out = Signal(object, int, float)  # from the layout thread: layout, version, seconds

    def __init__(self, link: KvEventsLink, *, budget_s: float = 0.008,
                 layout_every: float = 0.5, parent: QObject | None = None,
                 layout_fn: Callable[[FleetSnapshot], TreeLayout] = layout_fleet,
                 ) -> None:  # fmt: skip
        super().__init__(parent)
        self.link = link
        self.layout_fn = layout_fn  # the fleet panel's marks each block by its replicas
        self.tree = FleetTree()
        self.budget_s = budget_s
        self.layout_every = layout_every
        self.wanted = False  # the tab is shown: lay the tree out
        self.layout: TreeLayout | None = None
        self.chunks_applied = 0
        self.layout_seconds = 0.0  # the last layout's time on its thread
        self._busy = False
        self._closed = False
        self._laid_version = -1
        self._last_layout = -1e9
        self._gap = layout_every
        self._laid_out.connect(self._on_laid_out)

    def pump(self) -> int:
        """Apply delivered chunks until the budget is spent; start a layout when one is due.
        Returns how many chunks were applied."""
        deadline = time.perf_counter() + self.budget_s
        n = 0
        while time.perf_counter() < deadline:
            items = self.link.take(1)  # one chunk (<= chunk_blocks blocks) per budget check
            if not items:
                break
            name, item = items[0]
            if isinstance(item, Reset):
                self.tree.clear(name)
            else:
                self.tree.apply(name, item)
            n += 1
        self.chunks_applied += n
        self._maybe_layout()
        return n

    @property
    def behind(self) -> int:
        """Chunks the link has delivered that are not applied yet."""
        return self.link.pending

    def close(self) -> None:
        self._closed = True

    def _maybe_layout(self) -> None:
        if self._closed or not self.wanted or self._busy:
            return
        if self.tree.version == self._laid_version:
            return
        now = time.monotonic()
        if now - self._last_layout < self._gap:
            return
        self._busy, self._last_layout = True, now
        snapshot = self.tree.snapshot()
        threading.Thread(target=self._lay_out, args=(snapshot,), name="kvscope-tree-layout",
                         daemon=True).start()

    def _lay_out(self, snapshot: FleetSnapshot) -> None:
        t0 = time.perf_counter()
        try:
            layout = self.layout_fn(snapshot)
        except Exception:  # a bug must not leave the feed busy forever
            log.exception("laying out the remote prefix tree failed")
            layout = None
        try:
            self._laid_out.emit(layout, snapshot.version, time.perf_counter() - t0)
        except RuntimeError:  # the feed is gone (the window moved on)
            pass

    def _on_laid_out(self, layout: TreeLayout | None, version: int, seconds: float) -> None:
        self._busy = False
        self.layout_seconds = seconds
        # a big tree's layout holds the GIL the GUI thread shares: at most a fifth of the time
        self._gap = max(self.layout_every, 4 * seconds)
        if layout is None or self._closed:
            return
        self._laid_version = version
        self.layout = layout
        self.layout_ready.emit(layout)
