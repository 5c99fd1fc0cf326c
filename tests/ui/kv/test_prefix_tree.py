"""The prefix tree view: layout (ui/kv/prefix_tree_layout.py), the worker's tracker and the panel
(ui/kv/prefix_tree.py), from hand-built event batches whose tree is known; blocks only a lower KV
tier holds are drawn in that tier's hue, muted, and their hover says where they live."""

from __future__ import annotations

import hashlib

import numpy as np
from PySide6.QtGui import QColor

from ipc import kv_events as K
from ui.kv.prefix_tree import (
    BAR_COLOURS,
    CACHED_BAR,
    DISK_BAR,
    HOST_BAR,
    IN_USE_BAR,
    SELECTED_BAR,
    PrefixTreePanel,
)
from ui.kv.prefix_tree_layout import DISK_ONLY, HOST_ONLY, IN_POOL, TreeTracker, layout_tree
from ui.kv.tier_panel import TIER_COLOURS
from ui.telemetry import BLOCK_CACHED, BLOCK_IN_USE, Frame, RequestView

BS = 4


def h(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def stored(names: list[str], parent: str | None, first_id: int, medium: str = "pool"):
    """BlockStored of a chain; a lower tier's (first_id -1) names no pool blocks."""
    return K.BlockStored(
        block_hashes=[h(n) for n in names],
        parent_block_hash=None if parent is None else h(parent),
        token_ids=[t for n in names for t in [ord(n[0]) * 10 + int(n[1])] * BS],
        block_size=BS,
        block_ids=list(range(first_id, first_id + len(names))) if first_id >= 0 else [],
        medium=medium,
    )


def trunk_with_branches() -> K.KVEventBatch:
    """A 3-block system prompt (s0-s2) with three conversations on it, one of which forks."""
    return K.KVEventBatch(seq=1, time=0.0, events=[
        stored(["s0", "s1", "s2"], None, 0),
        stored(["a0", "a1"], "s2", 3),
        stored(["b0"], "s2", 5),
        stored(["c0", "c1", "c2"], "s2", 6),
        stored(["d0"], "c0", 9),
    ])  # fmt: skip


def test_layout_is_a_trunk_with_a_row_per_branch():
    tree = K.PrefixTree()
    assert tree.apply(trunk_with_branches())
    lay = layout_tree(tree)
    pos = {lay.hashes[i]: (lay.x0[i], lay.row[i]) for i in range(lay.num_blocks)}
    assert lay.num_blocks == 10 and lay.num_roots == 1
    # the trunk and the first branch (by first token) share row 0; x is the token position
    assert [pos[h(n)] for n in ("s0", "s1", "s2", "a0", "a1")] == [
        (0, 0), (4, 0), (8, 0), (12, 0), (16, 0)
    ]  # fmt: skip
    # later branches open rows below, the fork inside branch c below c's row
    assert pos[h("b0")] == (12, 1)
    assert pos[h("c0")] == (12, 2) and pos[h("c2")] == (20, 2)
    assert pos[h("d0")] == (16, 3)
    assert lay.num_rows == 4
    # each block's band spans the rows of every branch below it: the trunk all four
    span = {lay.hashes[i]: (lay.row[i], lay.row_end[i]) for i in range(lay.num_blocks)}
    assert span[h("s0")] == span[h("s2")] == (0, 3)
    assert span[h("a0")] == (0, 0) and span[h("c0")] == (2, 3) and span[h("c1")] == (2, 2)
    # the owner map draws them so, leaving the last half-row of each band empty
    # (row r covers y in [r - 0.5, r + 0.5); a band's gap is the lower half of its last row)
    assert lay.block_at(1, 2.9) == lay.hashes.index(h("s0"))
    assert lay.block_at(13, 2.9) == lay.hashes.index(h("c0"))
    assert lay.block_at(13, 1.2) is None  # the gap between bands b0 and c0
    assert lay.block_at(17, 2.7) == lay.hashes.index(h("d0"))
    assert lay.block_at(100, 0.0) is None and lay.block_at(-1, 0.0) is None


def test_removed_parent_leaves_its_children_as_a_root():
    tree = K.PrefixTree()
    tree.apply(trunk_with_branches())
    tree.apply(K.KVEventBatch(seq=2, time=0.0, events=[
        K.BlockRemoved(block_hashes=[h("c0")])
    ]))  # fmt: skip
    lay = layout_tree(tree)
    assert lay.num_roots == 3 and lay.num_blocks == 9
    assert sorted(tree.children()[None]) == sorted([h("s0"), h("c1"), h("d0")])
    # an orphan starts one block in (its prefix is unknown), apart from real first blocks
    pos = {lay.hashes[i]: lay.x0[i] for i in range(lay.num_blocks)}
    assert pos[h("s0")] == 0 and pos[h("c1")] == BS and pos[h("d0")] == BS


def test_tracker_asks_for_a_replay_once_per_period_after_a_lost_batch():
    t = TreeTracker(replay_every=2.0, layout_every=0.5)
    assert not t.needs_replay(0, now=0.0)  # an engine without KV events: never ask
    t.on_batch(trunk_with_branches())
    assert not t.needs_replay(1, now=0.1)
    assert t.needs_replay(3, now=0.2)  # batches 2 and 3 never arrived
    assert not t.needs_replay(3, now=1.0)  # asked already
    assert t.needs_replay(3, now=2.5)
    pool_only = K.KVEventBatch(seq=4, time=0.0, events=[K.AllBlocksCleared()])
    t.on_batch(pool_only)  # prefix caching turned off: the tiers' blocks may still be wrong
    assert t.needs_replay(4, now=5.0)
    clears = [K.AllBlocksCleared(medium=m) for m in ("pool", "host", "disk")]
    replay = K.KVEventBatch(seq=5, time=0.0, events=[*clears, stored(["x0"], None, 0)])
    t.on_batch(replay)
    assert not t.needs_replay(5, now=5.0) and list(t.tree.nodes) == [h("x0")]
    assert t.maybe_layout(now=5.0) is None  # the panel is not shown
    t.wanted = True
    assert t.maybe_layout(now=5.0).num_blocks == 1
    assert t.maybe_layout(now=9.0) is None  # nothing changed since


def _frame(states: dict[int, int], requests: list[RequestView], n: int = 12) -> Frame:
    state = np.zeros(n, np.uint8)
    for b, s in states.items():
        state[b] = s
    ref = (state == BLOCK_IN_USE).astype(np.int32)
    return Frame(
        time=10.0, state=state, ref_count=ref, filled=np.full(n, BS, np.int32),
        short_hash=np.zeros(n, np.uint32), parent=np.full(n, -1, np.int32),
        requests=requests, counters={"block_size": BS}, config={},
    )  # fmt: skip


def test_panel_colours_by_state_and_highlights_the_selected_request(qtbot):
    panel = PrefixTreePanel()
    qtbot.addWidget(panel)
    tree = K.PrefixTree()
    tree.apply(trunk_with_branches())
    lay = layout_tree(tree)
    panel.set_layout(lay)
    req = RequestView(request_id="r1", status="running", block_table=[0, 1, 2, 5],
                      num_prompt_tokens=16, num_cached_tokens=12, num_computed_tokens=16)
    states = {i: BLOCK_CACHED for i in range(10)} | {0: BLOCK_IN_USE, 1: BLOCK_IN_USE,
                                                     2: BLOCK_IN_USE, 5: BLOCK_IN_USE}
    panel.set_frame(_frame(states, [req]))
    panel.redraw()

    def kinds() -> dict[int, int]:
        return {int(lay.block_id[i]): int(panel.kind[i]) for i in range(lay.num_blocks)}

    def pixel(name: str) -> tuple[int, ...]:
        """The image at block `name`'s own row (sub-row 2 * row) and depth."""
        i = lay.hashes.index(h(name))
        return tuple(panel.image.image[2 * int(lay.row[i]), int(lay.x0[i]) // BS])

    in_use = {0, 1, 2, 5}
    assert kinds() == {b: IN_USE_BAR if b in in_use else CACHED_BAR for b in range(10)}
    assert pixel("s1") == tuple(BAR_COLOURS[IN_USE_BAR]) and pixel("a0") == tuple(
        BAR_COLOURS[CACHED_BAR]
    )
    assert panel.image.image.shape[:2] == (2 * lay.num_rows, 6)  # 4 rows, 6 blocks deep
    assert panel.image.image[2, 5, 3] == 0  # no block there: transparent
    panel.highlight_request("r1")
    panel.redraw()
    assert kinds() == {b: SELECTED_BAR if b in in_use else CACHED_BAR for b in range(10)}
    assert pixel("b0") == tuple(BAR_COLOURS[SELECTED_BAR])
    # the request's three cached blocks counted one hit each; hover names owner and hits
    assert panel.hits[[0, 1, 2, 5]].tolist() == [1, 1, 1, 0]
    i = panel.bar_at(5.0, 0.1)
    assert lay.hashes[i] == h("s1")
    text = panel.describe(i)
    assert "pool block 1" in text and "hits seen 1" in text and "owners: r1" in text
    assert panel.bar_at(100.0, 0.0) is None
    # the same request seen again is not a new hit
    panel.set_frame(_frame(states, [req]))
    assert panel.hits[0] == 1


def _tiered_batch() -> K.KVEventBatch:
    """trunk_with_branches, then a0-a1 written down to host memory and b0 to disk and all three
    evicted from the pool; s0 written down to both but kept in the pool."""
    return K.KVEventBatch(seq=2, time=0.0, events=[
        stored(["a0", "a1"], "s2", -1, "host"),
        stored(["b0"], "s2", -1, "disk"),
        stored(["s0"], None, -1, "host"),
        stored(["s0"], None, -1, "disk"),
        K.BlockRemoved(block_hashes=[h("a0"), h("a1"), h("b0")]),
    ])  # fmt: skip


def test_tier_only_blocks_keep_their_place_in_a_muted_tier_colour(qtbot):
    panel = PrefixTreePanel()
    qtbot.addWidget(panel)
    tree = K.PrefixTree()
    tree.apply(trunk_with_branches())
    tree.apply(_tiered_batch())
    lay = layout_tree(tree)
    where = {lay.hashes[i]: int(lay.tier[i]) for i in range(lay.num_blocks)}
    assert where[h("a0")] == where[h("a1")] == HOST_ONLY and where[h("b0")] == DISK_ONLY
    assert where[h("s0")] == where[h("c0")] == IN_POOL
    assert lay.num_blocks == 10 and lay.num_roots == 1  # evicted blocks stay in the tree
    panel.set_layout(lay)
    assert "2 in host memory only, 1 on disk only" in panel.note.text()
    assert "host memory" in panel.legend.text() and "disk" in panel.legend.text()
    states = {i: BLOCK_CACHED for i in range(10)}  # pool blocks 3-5 now hold nothing cached
    panel.set_frame(_frame(states, []))
    panel.redraw()

    def pixel(name: str) -> tuple[int, ...]:
        i = lay.hashes.index(h(name))
        return tuple(int(v) for v in panel.image.image[2 * int(lay.row[i]), int(lay.x0[i]) // BS])

    assert pixel("a0") == pixel("a1") == tuple(BAR_COLOURS[HOST_BAR])
    assert pixel("b0") == tuple(BAR_COLOURS[DISK_BAR])
    assert pixel("s0") == tuple(BAR_COLOURS[CACHED_BAR])  # in the pool: its pool state
    pool_colours = {tuple(BAR_COLOURS[k]) for k in (CACHED_BAR, IN_USE_BAR, SELECTED_BAR)}
    for name, tier in (("a0", "host"), ("b0", "disk")):
        drawn, strip = QColor(*pixel(name)), QColor(TIER_COLOURS[tier])
        assert pixel(name) not in pool_colours
        assert abs(drawn.hslHue() - strip.hslHue()) <= 10  # about the tiers strip's hue, muted
        assert drawn.value() < strip.value() and drawn.hslSaturation() < strip.hslSaturation()
    # hover: where it lives, and no pool block for a block the pool no longer holds
    i = panel.bar_at(13.0, -0.2)  # a0: tokens 12-15, row 0 (its band's upper half)
    assert lay.hashes[i] == h("a0")
    text = panel.describe(i)
    assert "evicted from the pool" in text and "host memory" in text and "pool block" not in text
    text = panel.describe(lay.hashes.index(h("b0")))
    assert "evicted from the pool" in text and "lives in: disk" in text
    text = panel.describe(lay.hashes.index(h("s0")))
    assert "evicted" not in text and "lives in: the pool, host memory, disk" in text
    assert "pool block 0" in text
