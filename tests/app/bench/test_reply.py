"""The window's own measurement, headless (app/bench/reply.py), against an engine process of the
default model (the tiny one has no chat template)."""

from __future__ import annotations

import re

import pytest

from app.bench import reply as bench_reply
from tests.ipc.helpers import EngineProc


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--repeats", "0"], "--repeats must be >= 1"),
        (["--max-tokens", "1"], "--max-tokens must be >= 2"),
        (["--load", "-1"], "--load must be >= 0"),
        (["--settle", "-2"], "--settle must be >= 0"),
    ],
)
def test_bad_arguments_name_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_reply.main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.slow
def test_a_reply_is_timed_alone_and_under_load(capsys):
    engine = EngineProc(["--num-blocks", "128", "--num-threads", "1", "--decode-step", "eager"])
    try:
        code = bench_reply.main(["--connect", engine.endpoint, "--load", "4", "--repeats", "1",
                                 "--settle", "0.5", "--max-tokens", "24"])
    finally:
        engine.stop()
    out = capsys.readouterr().out
    assert code == 0
    alone = re.search(r"reply alone: ([\d.]+) tok/s", out)
    loaded = re.search(r"reply with 4 load-generator chats: ([\d.]+) tok/s", out)
    load = re.search(r"load: ([\d.]+) tok/s generated, (\d+) chats finished, (\d+) errors", out)
    assert alone and loaded and load, out
    assert float(alone[1]) > 0 and float(loaded[1]) > 0
    assert float(load[1]) > 0 and load[3] == "0"
