"""The speculative decoding chart (ui/charts/spec.py under ui/charts/engine.py) from crafted
counters: hidden while the engine sends none, 'no drafts yet' before the first draft, then one
acceptance point per telemetry interval that verified drafts (the counters' deltas) and a bar per
draft position. The expected numbers are worked out by hand from the counters below."""

from __future__ import annotations

import numpy as np
import pytest

from ui.charts.engine import ChartsWidget
from ui.charts.spec import NO_DRAFTS
from ui.telemetry import Frame, History

PER_POS = "spec_decode_num_accepted_tokens_per_pos"


def frame(t: float, spec: tuple[int, int, int, list[int]] | None) -> Frame:
    counters = {"block_size": 16.0, "num_blocks_total": 4.0}
    if spec is not None:
        steps, drafted, accepted, per_pos = spec
        counters |= {"spec_decode_num_drafts": steps, "spec_decode_num_draft_tokens": drafted,
                     "spec_decode_num_accepted_tokens": accepted}
        counters |= {f"{PER_POS}:{i}": n for i, n in enumerate(per_pos)}
    return Frame.from_wire({"time": t, "blocks": {"state": np.zeros(4, np.uint8)},
                            "requests": [], "counters": counters, "config": {}})


def test_rate_per_interval_and_bars_per_position(qtbot) -> None:
    w = ChartsWidget()
    qtbot.addWidget(w)
    h = History()
    h.add(frame(100.0, None))
    w.refresh(h)
    assert w.spec.isHidden()  # the engine does not speculate

    h.add(frame(100.5, (0, 0, 0, [])))
    w.refresh(h)
    assert not w.spec.isHidden()
    assert w.spec.empty.isVisible()
    assert NO_DRAFTS in w.spec.p_rate.titleLabel.text

    # 2 steps of 4 drafts: 6 accepted (4 + 2)
    h.add(frame(101.0, (2, 8, 6, [2, 2, 1, 1])))
    h.add(frame(101.5, (2, 8, 6, [2, 2, 1, 1])))  # an interval without drafts: no point
    # 3 more steps, 12 more drafts: 3 more accepted (2 + 1 + 0)
    h.add(frame(102.0, (5, 20, 9, [4, 3, 1, 1])))
    w.refresh(h)
    x, y = w.spec.rate.getData()
    assert x.tolist() == pytest.approx([1.0, 2.0])  # seconds since the first frame
    assert y.tolist() == pytest.approx([75.0, 25.0])  # 6/8, 3/12
    assert not w.spec.empty.isVisible()
    title = w.spec.p_rate.titleLabel.text
    assert "45% all time" in title and "9/20 drafts" in title  # 9/20
    bars = w.spec.bars.opts
    assert list(bars["x"]) == [1, 2, 3, 4]
    assert list(bars["height"]) == [4, 3, 1, 1]
    # each bar's label: the share of the 5 speculative steps that got that far
    assert [lab.textItem.toPlainText() for lab in w.spec.bar_labels[:5]] == [
        "80%", "60%", "20%", "20%", ""]

    h.add(frame(102.5, None))  # speculation switched off (an engine restarted without it)
    w.refresh(h)
    assert w.spec.isHidden()
