"""ui/remote/remote_tree.py and tree_hover.py: the GUI side applies what the link delivers within
its time budget and lays the tree out on another thread only while wanted; colours by medium;
a huge tree is drawn with every n-th row (and says so) and the hover still finds its blocks."""

from __future__ import annotations

from PySide6.QtWidgets import QApplication

from ipc.vllm_events.events import Batch, Stored
from ipc.vllm_events.fleet_tree import FleetTree
from ipc.vllm_events.sequencer import Reset
from ui.kv.prefix_tree import PrefixTreePanel, sampled_note
from ui.kv.prefix_tree_layout import DISK_ONLY, HOST_ONLY, IN_POOL, layout_tree
from ui.remote.remote_tree import RemoteTreeFeed, fleet_tier, layout_fleet
from ui.remote.tree_hover import describe_block, hash_text
from ui.window.main_window import wait_until


class FakeLink:
    def __init__(self, items) -> None:
        self.items = list(items)

    def take(self, n: int):
        out, self.items = self.items[:n], self.items[n:]
        return out

    @property
    def pending(self) -> int:
        return len(self.items)


def chain(first: int, n: int, parent=None, medium="GPU") -> Stored:
    hashes = tuple(range(first, first + n))
    return Stored(block_hashes=hashes, parent_block_hash=parent,
                  token_ids=tuple(t for h in hashes for t in (h, h)), block_size=2, medium=medium)


def test_pump_applies_within_its_budget_and_lays_out_only_when_wanted(qapp):
    items = [("a", Batch(seq=i, ts=0.0, events=[chain(100 * i, 50)])) for i in range(400)]
    link = FakeLink(items + [("a", Reset("restart")), ("a", Batch(1, 0.0, [chain(1, 3)]))])
    feed = RemoteTreeFeed(link, budget_s=0.002)  # type: ignore[arg-type]
    got = []
    feed.layout_ready.connect(got.append)
    n = feed.pump()
    assert 0 < n < 400 and feed.behind == 402 - n  # the rest waits for later ticks
    while feed.pump():
        pass
    assert list(feed.tree.nodes) == [1, 2, 3] and not got  # not wanted: no layout
    feed.wanted = True
    feed.pump()
    assert wait_until(lambda: bool(got), 10, QApplication.instance())
    assert got[-1].num_blocks == 3 and feed.layout is got[-1]


def test_media_pick_the_colour_tier():
    assert fleet_tier(frozenset({"GPU", "CPU"})) == IN_POOL
    assert fleet_tier(frozenset({"CPU_PINNED", "DISK"})) == HOST_ONLY
    assert fleet_tier(frozenset({"STORAGE"})) == fleet_tier(frozenset({"EXTERNAL"})) == DISK_ONLY
    assert fleet_tier(frozenset({"SOMETHING_NEW"})) == DISK_ONLY


def test_a_huge_tree_is_drawn_with_every_nth_row_and_hovers_still_work(qapp):
    t = FleetTree()
    events = [chain(1, 4)] + [chain(1000 + 10 * k, 3, parent=4) for k in range(200)]
    t.apply("a", Batch(0, 0.0, events))
    full = layout_fleet(t)
    small = layout_tree(t, tier_of=fleet_tier, max_cells=100)
    assert full.row_step == 1 and small.row_step > 1
    assert small.owner.shape[0] * small.owner.shape[1] <= 100 + small.owner.shape[1]
    assert "1 row in" in sampled_note(small) and sampled_note(full) == ""
    for i in range(small.num_blocks):  # wherever the image has the block, the hover finds it
        rows, cols = (small.owner == i).nonzero()
        for r, c in zip(rows, cols, strict=True):
            y = (r * small.row_step) / 2 - 0.5 + 0.01
            assert small.block_at(c * small.block_size + 0.5, y) == i
    trunk = small.hashes.index(1)
    assert (small.owner == trunk).any()  # the shared trunk always shows
    panel = PrefixTreePanel()
    panel.use_remote(lambda lay, i: "", "waiting")
    panel.set_layout(small, note="n")
    panel.redraw()
    assert panel.image.image.shape[:2] == small.owner.shape


def test_the_hover_of_a_remote_block():
    t = FleetTree()
    t.apply("tcp://a:1", Batch(0, 0.0, [chain(7, 2, medium="CPU")]))
    t.apply("tcp://b:1", Batch(0, 0.0, [chain(7, 1)]))
    lay = layout_fleet(t)
    i = lay.hashes.index(7)
    text = describe_block(lay, i, t.sources_holding, lambda toks: None)
    assert text.splitlines() == [f"tokens 0–1 · hash {7:016x}", "lives in: CPU, GPU",
                                 "held by 2: tcp://a:1, tcp://b:1", "token ids: [7, 7]"]
    assert "text: 'hi'" in describe_block(lay, i, t.sources_holding, lambda toks: "hi")
    assert hash_text(b"\x01\x02" * 16) == "0102010201020102"
    assert hash_text(-1) == "f" * 16
