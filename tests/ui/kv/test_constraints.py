"""The request table's constraint column and the detail pane's allowed-token counts, fed
telemetry with agents' requests (a grammar, tools, both, neither)."""

from __future__ import annotations

import math

import msgspec
import numpy as np

from ipc import protocol as P
from ui.kv.block_map import BlockMapWidget
from ui.kv.constraints import SPARK, constraint_label, sparkline
from ui.kv.request_table import TABLE_COLUMNS
from ui.telemetry import Frame

VOCAB = 49152


def _snapshot(requests: list[dict]) -> P.Telemetry:
    n = 32
    state = np.zeros(n, np.uint8)
    state[:8] = 2
    blocks = P.BlockArrays.pack(state=state, ref_count=(state > 0).astype(np.int32),
                                filled=np.zeros(n, np.int32), short_hash=np.zeros(n, np.uint32),
                                parent=np.full(n, -1, np.int32))  # fmt: skip
    base = dict(status="running", num_prompt_tokens=20, num_cached_tokens=0,
                num_computed_tokens=20, num_generated_tokens=5, arrival_time=0.0)  # fmt: skip
    reqs = [msgspec.convert({**base, **r}, P.RequestState) for r in requests]
    config = P.LiveConfig(max_num_seqs=8, max_num_batched_tokens=256, long_prefill_chunk=64,
                          enable_prefix_caching=True)  # fmt: skip
    return P.Telemetry(seq=1, time=1.0, counters={"block_size": 16}, config=config,
                       blocks=blocks, requests=reqs)  # fmt: skip


ALLOWED = [VOCAB, 1, 1, 312, 1, 5, 1, 1, 40, VOCAB, 2, 1]


def _frame() -> Frame:
    # through the wire codec, as the window receives it
    snap = _snapshot([
        {"request_id": "plain", "block_table": [0, 1]},
        {"request_id": "schema", "block_table": [2, 3], "structured": "json",
         "allowed_tokens": ALLOWED},
        {"request_id": "agent", "block_table": [4, 5], "structured": "json", "num_tools": 2,
         "allowed_tokens": [1, 1]},
        {"request_id": "tools", "block_table": [6, 7], "num_tools": 1},
    ])  # fmt: skip
    return Frame.from_wire(P.decode_pub(P.encode(snap)))


def test_table_marks_requests_with_a_grammar_or_tools(qtbot) -> None:
    w = BlockMapWidget()
    qtbot.addWidget(w)
    w.set_frame(_frame())
    w.redraw(force=True)
    col = TABLE_COLUMNS.index("constraint")
    marks = {w.table.item(r, 0).text(): w.table.item(r, col).text()
             for r in range(w.table.rowCount())}  # fmt: skip
    assert marks == {"plain": "", "schema": "json", "agent": "json + tools 2", "tools": "tools 1"}
    row = [w.table.item(r, 0).text() for r in range(w.table.rowCount())].index("tools")
    assert "1 tool offered" in w.table.item(row, col).toolTip()


def test_detail_shows_what_the_grammar_allowed(qtbot) -> None:
    w = BlockMapWidget()
    qtbot.addWidget(w)
    w.vocab_size = VOCAB
    w.set_frame(_frame())
    w.highlight_request("schema")
    w.redraw(force=True)
    text = w.block_table.toPlainText()
    forced = sum(1 for c in ALLOWED if c == 1)  # recounted here, not by the widget's code
    median = sorted(ALLOWED)[len(ALLOWED) // 2]
    assert f"last {len(ALLOWED)} steps: {forced} forced" in text
    assert f"median {median:,} allowed" in text
    assert " ".join(map(str, ALLOWED)) in text
    assert f"vocabulary {VOCAB:,}" in text
    w.highlight_request("plain")
    w.redraw(force=True)
    assert "grammar" not in w.block_table.toPlainText()


def test_sparkline_is_a_log_scale_from_one_token_to_the_vocabulary() -> None:
    line = sparkline([1, VOCAB, int(math.sqrt(VOCAB))], VOCAB)
    assert line[0] == SPARK[1] and line[1] == SPARK[-1]
    assert SPARK.index(line[0]) < SPARK.index(line[2]) < SPARK.index(line[1])
    assert constraint_label(_frame().requests[0]) == ""
