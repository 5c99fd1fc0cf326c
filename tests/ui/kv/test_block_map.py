"""Block map and charts, fed synthetic telemetry: cell colours, tooltip, hover mapping,
highlighting, the block table, and chart items created once."""

from __future__ import annotations

import numpy as np
import pytest
from PySide6.QtCore import QPointF

from ui.charts.engine import ChartsWidget
from ui.engine.synthetic import SyntheticEngine
from ui.kv import block_map as bm
from ui.kv.block_map import BlockMapWidget
from ui.kv.request_table import TABLE_COLUMNS
from ui.telemetry import BLOCK_CACHED, BLOCK_EMPTY, BLOCK_IN_USE, Frame, History


@pytest.fixture(scope="module")
def frames():
    eng = SyntheticEngine(num_blocks=150, seed=5)
    out = []
    for i in range(240):
        if i % 5 == 0:
            eng.add()
        eng.step()
        if i % 2 == 0:
            out.append(Frame.from_wire(eng.snapshot()))
    return out


def test_cells_follow_block_states(qtbot, frames):
    w = BlockMapWidget()
    qtbot.addWidget(w)
    w.resize(900, 400)
    f = frames[-1]
    assert np.count_nonzero(f.state == BLOCK_IN_USE) and np.count_nonzero(f.state == BLOCK_CACHED)
    assert np.count_nonzero((f.state == BLOCK_IN_USE) & (f.ref_count > 1)), "want shared blocks"
    w.set_frame(f)
    w.redraw()
    idx = w.colour_index
    for b in range(f.num_blocks):
        if f.state[b] == BLOCK_EMPTY:
            assert idx[b] == bm.EMPTY
        elif f.state[b] == BLOCK_CACHED:
            assert idx[b] == bm.CACHED
        elif f.ref_count[b] > 1:
            assert idx[b] == bm.SHARED
        else:
            assert bm.REQ0 <= idx[b] < bm.REQ0 + bm.NREQ
    # blocks of one (unshared) request share its colour; two live requests usually differ
    tables = {r.request_id: [b for b in r.block_table if f.ref_count[b] == 1]
              for r in f.requests if r.block_table}
    colours = {rid: {int(idx[b]) for b in t} for rid, t in tables.items() if t}
    assert all(len(c) == 1 for c in colours.values())
    # legend counts match the frame
    text = w.legend.text()
    assert f"cached {np.count_nonzero(f.state == BLOCK_CACHED)}" in text
    # the request table lists every live request
    assert w.table.rowCount() == len([r for r in f.requests if r.status != "finished"])


def test_image_pixels_use_the_discrete_lut(qtbot, frames):
    w = BlockMapWidget()
    qtbot.addWidget(w)
    f = frames[-1]
    w.set_frame(f)
    w.redraw()
    img = w.image.image
    rows, cols = w._shape
    assert img.shape == (rows * w.pitch, cols * w.pitch) and img.dtype == np.uint8
    # the top-left pixel of cell b holds the colour index of block b
    for b in range(f.num_blocks):
        r, c = divmod(b, cols)
        assert img[r * w.pitch, c * w.pitch] == w.colour_index[b]
    assert w.image.levels is not None and list(w.image.levels) == [0, bm.LUT_SIZE]


def test_hover_and_tooltip(qtbot, frames):
    w = BlockMapWidget()
    qtbot.addWidget(w)
    w.resize(800, 400)
    w.show()
    f = frames[-1]
    w.set_frame(f)
    w.redraw()
    qtbot.wait(50)
    shared = int(np.flatnonzero((f.state == BLOCK_IN_USE) & (f.ref_count > 1))[0])
    rows, cols = w._shape
    r, c = divmod(shared, cols)
    centre = w.image.mapToScene(QPointF(c * w.pitch + w.cell / 2, r * w.pitch + w.cell / 2))
    assert w.block_at(centre) == shared
    tip = w.tooltip_text(shared)
    owners = [x.request_id for x in f.requests if shared in x.block_table]
    assert f"block {shared}" in tip and "state: shared" in tip
    assert f"ref count: {int(f.ref_count[shared])}" in tip
    assert all(o in tip for o in owners)
    assert f"{int(f.short_hash[shared]):08x}" in tip
    assert f"filled: {int(f.filled[shared])}/{f.block_size}" in tip


def test_highlight_dims_other_blocks_and_lists_the_block_table(qtbot, frames):
    w = BlockMapWidget()
    qtbot.addWidget(w)
    f = frames[-1]
    req = max((r for r in f.requests if r.block_table), key=lambda r: len(r.block_table))
    w.set_frame(f)
    w.highlight_request(req.request_id)
    rows, cols = w._shape
    img = w.image.image
    mine = set(req.block_table)
    for b in range(f.num_blocks):
        r, c = divmod(b, cols)
        dimmed = img[r * w.pitch, c * w.pitch] >= bm.DIM
        assert dimmed == (b not in mine)
    text = w.block_table.toPlainText()
    for i, b in enumerate(req.block_table):
        assert f"{i:5d} → {b:<8d}" in text
    # a finished request: its blocks that still hold the same hash stay highlighted
    h = History()
    for fr in frames:
        h.add(fr)
    gone = next(rid for rid in h.last_tables if rid not in {r.request_id for r in f.requests})
    table, hashes = h.last_tables[gone]
    w.set_frame(f, h.last_tables)
    w.highlight_request(gone)
    expect = {b for b, x in zip(table, hashes, strict=True) if x and f.short_hash[b] == x}
    assert w.highlight_blocks == expect


def test_big_pools_get_small_cells(qtbot):
    w = BlockMapWidget()
    qtbot.addWidget(w)
    eng = SyntheticEngine(num_blocks=100_000, seed=2)
    for _ in range(5):
        eng.add(prompt=200)
    for _ in range(30):
        eng.step()
    f = Frame.from_wire(eng.snapshot())
    w.set_frame(f)
    w.redraw()
    rows, cols = w._shape
    assert (w.cell, w.pitch) == (1, 1) and w.image.image.shape == (rows, cols)
    np.testing.assert_array_equal(w.image.image.reshape(-1)[: f.num_blocks], w.colour_index)


def test_charts_items_are_created_once(qtbot, frames):
    c = ChartsWidget()
    qtbot.addWidget(c)
    items = [list(p.items) for p in c.plots]
    h = History()
    for f in frames:
        h.add(f)
        c.refresh(h)
    assert [list(p.items) for p in c.plots] == items
    # the data given to the items (before clipping/downsampling for display)
    np.testing.assert_allclose(c.gtps.yData, h.frames.view()[:, History.GTPS])
    itl = h.itl.view()
    from ui.charts.engine import MAX_POINTS

    inside = itl[itl[:, 0] >= 0]
    assert len(c.itl.xData) == min(len(inside), MAX_POINTS) > 0
    # evenly thinned: first and last points kept, values are a subset of the real ones
    assert c.itl.xData[0] == inside[0, 0] and c.itl.xData[-1] == inside[-1, 0]
    assert np.isin(c.itl.yData, np.log10(np.maximum(inside[:, 1] * 1e3, 1e-2))).all()
    c.clear()
    assert c.gtps.xData is None or len(c.gtps.xData) == 0


def test_request_table_and_tooltip_name_each_origin(qtbot):
    n = 8
    state = np.array([BLOCK_IN_USE] * 4 + [BLOCK_EMPTY] * 4, np.uint8)
    snap = dict(
        time=1.0,
        blocks=dict(state=state, ref_count=np.array([1, 1, 2, 1, 0, 0, 0, 0], np.int32),
                    filled=np.full(n, 3, np.int32), short_hash=np.arange(n, dtype=np.uint32),
                    parent=np.full(n, -1, np.int32)),
        requests=[
            dict(request_id="cmpl-1", status="running", block_table=[0, 2], origin="http"),
            dict(request_id="chat-7", status="running", block_table=[1, 2], origin="gui"),
            dict(request_id="load-3-abc", status="running", block_table=[3], origin="gui"),
            dict(request_id="old", status="waiting", block_table=[]),  # engine without origins
        ],
        counters={"block_size": 16.0}, config={},
    )
    w = BlockMapWidget()
    qtbot.addWidget(w)
    w.set_frame(Frame.from_wire(snap))
    w.redraw()
    col = TABLE_COLUMNS.index("origin")
    assert w.table.horizontalHeaderItem(col).text() == "origin"
    shown = {w.table.item(r, 0).text(): w.table.item(r, col).text()
             for r in range(w.table.rowCount())}
    assert shown == {"cmpl-1": "http", "chat-7": "gui", "load-3-abc": "load", "old": "?"}
    tip = w.tooltip_text(2)
    assert "owners: cmpl-1 (http), chat-7 (gui)" in tip
    assert "owners: load-3-abc (load)" in w.tooltip_text(3)
    assert "owners: —" in w.tooltip_text(5)


def test_live_titles_never_re_layout_the_charts(qtbot, frames):
    """A title's numbers change twice a second; if its text width reached the layout, every
    change resized all plots and repainted every chart at once (tens of ms in the GUI thread)."""
    c = ChartsWidget()
    qtbot.addWidget(c)
    c.resize(900, 400)
    c.show()
    h = History()
    for f in frames:
        h.add(f)
    c.refresh(h)
    qtbot.wait(50)
    before = [p.vb.sceneBoundingRect() for p in c.plots]
    for width in (1, 80, 3, 200):
        for p in c.plots:
            c._title(p, "x" * width)
        qtbot.wait(20)
        assert [p.vb.sceneBoundingRect() for p in c.plots] == before, width
    # the text stays inside its plot: clipped, not drawn over the neighbour's title
    label = c.p_latency.titleLabel
    assert label.flags() & label.GraphicsItemFlag.ItemClipsChildrenToShape


def test_a_branch_hit_is_noted_from_any_frame_of_a_batch(qtbot, frames):
    """Frames reach the window in batches and only the last is drawn: a branch's hit blocks
    come from whichever frame shows its request live, though the drawn one shows it finished
    (a short reply on a loaded machine); the drawn frame alone has nothing to mark them by."""
    first, rid = next((i, r.request_id) for i, f in enumerate(frames) for r in f.requests
                      if r.num_cached_tokens and r.status != "finished")  # fmt: skip
    gone = next(j for j in range(first + 1, len(frames))
                if all(r.request_id != rid for r in frames[j].requests))  # fmt: skip
    live = next(r for r in frames[first].requests if r.request_id == rid)
    hit = set(live.block_table[: live.num_cached_tokens // frames[first].block_size])
    history = History()
    for f in frames[: gone + 1]:
        history.add(f)
    marked = {}
    for noted in (True, False):
        w = BlockMapWidget()
        qtbot.addWidget(w)
        w.show_fork(rid, "the branch it forked from")
        if noted:  # the batch frames[first..gone], as the window's feed takes it
            for f in frames[first:gone]:
                w.note_frame(f)
        w.set_frame(frames[gone], history.last_tables)
        w.redraw(force=True)
        assert w.highlight_blocks, "its blocks still hold its prefix"
        marked[noted] = (w.fork_blocks, w.highlight_blocks)
    fork, held = marked[True]
    assert fork and fork == hit & held  # the hit blocks it still holds
    assert not marked[False][0]
