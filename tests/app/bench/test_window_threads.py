"""The window thread-count study: it reads the figures `python -m app --measure-latency
--measure-reply` prints (the very print functions, so a format change fails here), and its
table's medians and ratios against a hand-computed case."""

from __future__ import annotations

import contextlib
import io

from app.bench.window_threads import LOAD_P99, LOAD_TPS, REPLY, table
from app.headless import print_reply


def test_the_study_parses_what_the_app_prints() -> None:
    out = io.StringIO()
    latency = {"p50": 3.0, "p99": 41.5, "max": 60.0}
    with contextlib.redirect_stdout(out):
        print_reply("reply alone", {"done": True, "tok_s": 29.25, "ttft": 0.2,
                                    "completion_tokens": 128, "latency": latency})
        print_reply("reply under load 16", {"done": True, "tok_s": 7.5, "ttft": 1.5,
                                            "completion_tokens": 120, "latency": latency})
        print_reply("reply under load 16", {"done": False})
    text = out.getvalue() + (
        "  under load: samples 900  p50 2.0 ms  p90 9.0 ms  p99 33.3 ms  max 80.0 ms  (target "
        "p99 < 50 ms)\n  load chats: 61.5 tok/s generated over the 10 s window\n")
    assert REPLY.findall(text) == [("reply alone", "128", "29.2", "41.5"),
                                   ("reply under load 16", "120", "7.5", "41.5")]
    assert "did not finish" in text
    assert LOAD_P99.search(text).group(1) == "33.3"
    assert LOAD_TPS.search(text).group(1) == "61.5"


def test_table_gives_medians_and_ratios_to_the_first_thread_count() -> None:
    rows = {
        1: [{"alone_tok_s": 20.0, "alone_p99": 10.0}, {"alone_tok_s": 30.0, "alone_p99": 30.0},
            {"alone_tok_s": 26.0, "alone_p99": 20.0}],
        2: [{"alone_tok_s": 39.0, "alone_p99": 40.0}],
    }
    lines = table(rows).splitlines()
    assert lines[2].startswith("| 1 | 26.0 | 20.0 | n/a")
    assert lines[3].startswith("| 2 | 39.0 (1.50x) | 40.0 (2.00x) | n/a")
