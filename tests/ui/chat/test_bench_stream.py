"""The streaming benchmark still runs (ui/chat/bench_stream.py; its numbers are not checked here):
a tiny conversation, both views, a fraction of a second each."""

from __future__ import annotations

import argparse

from ui.chat import bench_stream, message_view


def test_bench_runs_both_views(qtbot, monkeypatch):
    monkeypatch.setattr(message_view, "MARKDOWN", True)  # run() sets it: restored after
    args = argparse.Namespace(messages=6, rate=100.0, seconds=0.4)
    plain, markdown = bench_stream.run(False, args), bench_stream.run(True, args)
    assert plain.deltas > 0 and plain.renders == plain.deltas + 1  # each delta, then the final
    assert 0 < markdown.renders < markdown.deltas and markdown.other_renders == 0
    assert markdown.lat.size > 0 and "p99" in markdown.line()
