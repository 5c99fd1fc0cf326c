"""The status bar's decode-step line (ui/window/decode_status.py): which CPU decode step runs
and why, from the engine's telemetry (`decode_step`, `decode_detail`)."""

from __future__ import annotations

from PySide6.QtWidgets import QStatusBar

from ui.telemetry import Frame
from ui.window.decode_status import decode_status_text
from ui.window.status_bar import StatusBarView


def test_the_text_says_which_step_runs_and_why():
    assert decode_status_text("fused", "avx2_fp32") == "decode: fused (AVX2 int4)"
    assert decode_status_text("fused", "avx512_bf16") == "decode: fused (AVX-512 bf16 int4)"
    assert decode_status_text("building", "here") == (
        "decode: eager while the fused step compiles (first start, ~1 min)")
    assert "compiles in another process" in decode_status_text("building", "elsewhere")
    assert decode_status_text("eager", "needs decode_weights='int4'") == (
        "decode: eager: needs decode_weights='int4'")
    assert decode_status_text("", "") == ""  # a GPU engine, an older engine: no line


def test_the_label_follows_the_telemetry_and_hides_without_a_step(qtbot):
    bar = QStatusBar()
    qtbot.addWidget(bar)
    view = StatusBarView(bar)
    wire = {"blocks": {"state": b""}, "decode_step": "building", "decode_detail": "here"}
    frame = Frame.from_wire(wire)
    view.show_decode_step(frame.decode_step, frame.decode_detail)
    assert "compiles" in view.decode_label.text() and not view.decode_label.isHidden()
    view.show_decode_step("fused", "avx2_fp32")
    assert view.decode_label.text() == "decode: fused (AVX2 int4)"
    view.show_decode_step("", "")
    assert view.decode_label.isHidden()


def test_the_speculation_line_reads_vllms_counters():
    from ui.window.status_bar import spec_counters_text

    assert spec_counters_text({}) == ""
    assert spec_counters_text({"spec_decode_num_draft_tokens": 0.0}) == ""
    c = {"spec_decode_num_drafts": 10.0, "spec_decode_num_draft_tokens": 40.0,
         "spec_decode_num_accepted_tokens": 38.0,
         "spec_decode_num_accepted_tokens_per_pos:1": 10.0,
         "spec_decode_num_accepted_tokens_per_pos:0": 10.0,
         "spec_decode_num_accepted_tokens_per_pos:3": 9.0,
         "spec_decode_num_accepted_tokens_per_pos:2": 9.0}
    assert spec_counters_text(c) == ("speculation: 38/40 draft tokens accepted (95%) · "
                                     "by position 10 10 9 9")
