"""The block map marks speculative decoding's last step (issue 35): from a crafted frame whose
request drafted 4 tokens at positions 3-6 with block_size 4 and had 1 confirmed, the map outlines
the two blocks the drafts were written to, marks the one whose rejected drafts were rolled back,
and the detail pane draws the slots; the next frame (no step since) drops the marks.

The expected slots are written out by hand from that scenario (not computed by the code under
test): block 2 holds positions 0-3, the first three computed before the step and 3 the confirmed
draft; block 6 held positions 4-7, where drafts 4-6 were rejected, and the rollback freed it."""

from __future__ import annotations

import numpy as np

from ui import theme
from ui.kv.block_map import BlockMapWidget
from ui.kv.spec_marks import SLOT_CONFIRMED, SLOT_EMPTY, SLOT_KV, SLOT_ROLLED_BACK
from ui.telemetry import BLOCK_EMPTY, BLOCK_IN_USE, Frame

NUM_BLOCKS = 12
SPEC_COUNTERS = {"block_size": 4.0, "spec_decode_num_drafts": 10.0,
                 "spec_decode_num_draft_tokens": 40.0, "spec_decode_num_accepted_tokens": 31.0}


def crafted(with_step: bool) -> Frame:
    state = np.full(NUM_BLOCKS, BLOCK_EMPTY, np.uint8)
    state[[2, 3]] = BLOCK_IN_USE
    ref = (state == BLOCK_IN_USE).astype(np.int32)
    step = {"draft_start": 3, "draft_blocks": [2, 6, 6, 6], "draft_accepted": 1} if with_step \
        else {}
    return Frame.from_wire({
        "time": 5.0,
        "blocks": {"state": state, "ref_count": ref, "filled": np.where(ref > 0, 4, 0),
                   "short_hash": np.zeros(NUM_BLOCKS, np.uint32),
                   "parent": np.full(NUM_BLOCKS, -1, np.int32)},
        "requests": [
            {"request_id": "spec", "status": "running", "block_table": [2],
             "num_prompt_tokens": 3, "num_computed_tokens": 4, "num_generated_tokens": 2,
             "num_draft_tokens": 40, "num_accepted_tokens": 31, **step},
            {"request_id": "plain", "status": "running", "block_table": [3],
             "num_prompt_tokens": 4, "num_computed_tokens": 4},
        ],
        "counters": SPEC_COUNTERS,
        "config": {},
    })


def test_map_and_detail_mark_drafted_and_rolled_back_slots(qtbot) -> None:
    w = BlockMapWidget()
    qtbot.addWidget(w)
    w.resize(900, 400)
    w.set_frame(crafted(with_step=True))
    w.highlight_request("spec")
    assert w.spec.shown.drafted == {2, 6}
    assert w.spec.shown.rolled_back == {6}
    # drawn where the cells are: the outline's centres on blocks 2 and 6 of the grid
    rows, cols = w._shape
    xs, ys = w.spec.drafted.getData()
    centres = sorted(zip(xs.tolist(), ys.tolist(), strict=True))
    want = sorted(((b % cols) * w.pitch + w.cell / 2, (b // cols) * w.pitch + w.cell / 2)
                  for b in (2, 6))
    assert centres == want
    assert len(w.spec.rolled_back.getData()[0]) == 1
    legend = w.legend.text()
    assert f"color:{theme.SPEC_DRAFT}" in legend and "drafted 2" in legend
    assert f"color:{theme.SPEC_ROLLBACK}" in legend and "rolled back 1" in legend

    text = w.block_table.toPlainText()
    kv, ok, rb, em = SLOT_KV, SLOT_CONFIRMED, SLOT_ROLLED_BACK, SLOT_EMPTY
    table_line = next(line for line in text.splitlines() if line.lstrip().startswith("0 → 2"))
    assert table_line.endswith(kv * 3 + ok)
    freed = next(line for line in text.splitlines() if line.lstrip().startswith("1 → 6"))
    assert rb * 3 + em in freed and "freed" in freed
    assert "4 drafts at positions 3–6, 1 confirmed, 3 rolled back" in text
    assert "drafts 31/40 accepted (78%)" in text
    assert w.tooltip_text(6).endswith("\ndrafts of spec: slots 0–2, slots 0–2 rolled back")
    assert w.tooltip_text(2).endswith("\ndrafts of spec: slot 3")
    assert "drafts of" not in w.tooltip_text(3)

    # the next frame has no step since: the marks go
    w.set_frame(crafted(with_step=False))
    w.redraw()
    assert w.spec.shown.drafted == set() and w.spec.shown.rolled_back == set()
    assert len(w.spec.drafted.getData()[0]) == 0
    assert "drafted 0" in w.legend.text()
    assert "last speculative step" not in w.block_table.toPlainText()


def test_no_spec_legend_without_speculation(qtbot) -> None:
    w = BlockMapWidget()
    qtbot.addWidget(w)
    f = crafted(with_step=False)
    f.counters = {"block_size": 4.0}
    w.set_frame(f)
    w.redraw()
    assert "drafted" not in w.legend.text()
