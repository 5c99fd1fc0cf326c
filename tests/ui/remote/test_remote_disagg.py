"""The window attached over HTTP to a disaggregated KVScope deployment, against a scripted
stand-in (tests/app/remote/fake_disagg.py): thirteen snapshots per engine, one a second, each engine
on a clock of its own. What the window shows is worked out by hand from those counters below.

Rates are over the last 10 s: snapshots 2..12 (the burst in snapshots 0..2 is outside it, so a
rate taken over every snapshot would differ)."""

from __future__ import annotations

import re

import numpy as np
import pytest
from PySide6.QtWidgets import QApplication

from app.conversations import ConversationStore
from app.settings import open_settings
from ipc import protocol as P
from tests.app.remote.fake_disagg import FakeDisagg, snapshot, welcome
from tests.app.remote.fake_server import FakeServer, fixture_texts
from ui.kv.block_map import CACHED, EMPTY, REQ0
from ui.window.main_window import EngineSource, MainWindow, wait_until

N = 13  # snapshots per engine, at t0 + 0, 1, ..., 12 s
FAST = {"scrape_interval": 0.1, "retry_interval": 0.2, "scrape_timeout": 5.0,
        "connect_timeout": 5.0, "stall_timeout": 120.0}  # fmt: skip
BLOCK_BYTES = 64_000
# decode engine, per snapshot
PULLS = [0, 10, 20, *(20 + i for i in range(1, 11))]  # 30 at the end, 10 in the window
PULL_SECONDS = [0.0, 5.0, 10.0, *(10.0 + 0.025 * i for i in range(1, 11))]  # 10.25
BLOCKS = [0, 500, 1000, 1010, 1025, 1035, 1050, 1060, 1075, 1085, 1100, 1110, 1125]
FAILURES = [0, 3, 3, 3, 3, 3, 3, 4, 4, 4, 4, 4, 5]
PENDING = [0, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 2, 3]


def _request(rid: str, table: list[int]) -> P.RequestState:
    return P.RequestState(request_id=rid, status="running", block_table=table,
                          num_prompt_tokens=80, num_cached_tokens=0, num_computed_tokens=80,
                          num_generated_tokens=1, arrival_time=1.0, origin="http")  # fmt: skip


def _state(in_use: int, cached: int, total: int) -> np.ndarray:
    return np.array([2] * in_use + [1] * cached + [0] * (total - in_use - cached), np.uint8)


def prefill_snaps() -> list[P.Telemetry]:
    # 80 blocks: 0-4 held by a request, 5-7 in use by none (leased), 8-19 cached, 20-79 empty
    state = _state(8, 12, 80)
    out = []
    for i in range(N):
        c = {"prompt_tokens_total": 160.0 * i, "generation_tokens_total": 1.0 * i,
             "num_requests_running": 1, "num_requests_waiting": 2, "num_blocks_total": 80,
             "num_blocks_in_use": 8, "num_blocks_cached": 12, "num_blocks_empty": 60,
             "block_size": 16, "kv_transfer_leases_active": 2 if i == N - 1 else 5,
             "kv_transfer_leases_expired": 1, "kv_transfer_leases_granted": 31}  # fmt: skip
        out.append(snapshot(i + 1, 100.0 + i, c, state, [_request("chatcmpl-x-0", [0, 1, 2,
                                                                               3, 4])]))
    return out


def decode_snaps() -> list[P.Telemetry]:
    # 100 blocks: 0-9 held by two requests, 10-39 cached, 40-99 empty
    state = _state(10, 30, 100)
    reqs = [_request("chatcmpl-x-0", list(range(5))), _request("chatcmpl-y-0", list(range(5, 10)))]
    out = []
    for i in range(N):
        c = {"prompt_tokens_total": 16.0 * i, "generation_tokens_total": 40.0 * i,
             "num_requests_running": 2, "num_requests_waiting": 0, "num_blocks_total": 100,
             "num_blocks_in_use": 10, "num_blocks_cached": 30, "num_blocks_empty": 60,
             "block_size": 16, "kv_transfer_pulls": PULLS[i],
             "kv_transfer_pull_seconds": PULL_SECONDS[i],
             "kv_transfer_blocks_received": BLOCKS[i],
             "kv_transfer_bytes_received": BLOCKS[i] * BLOCK_BYTES,
             "kv_transfer_pull_failures": FAILURES[i], "kv_transfer_pulls_pending": PENDING[i],
             "kv_transfer_blocks_already_cached": 40, "kv_transfer_releases": 1}  # fmt: skip
        out.append(snapshot(i + 1, 500.0 + i, c, state, reqs))
    return out


@pytest.fixture
def fake():
    server = FakeDisagg({"prefill": welcome("prefill", 80), "decode": welcome("decode", 100)},
                        {"prefill": prefill_snaps(), "decode": decode_snaps()})
    with server:
        yield server


@pytest.fixture
def window(qapp, tmp_path):
    windows: list[MainWindow] = []

    def make(url: str) -> MainWindow:
        d = tmp_path / f"data{len(windows)}"
        w = MainWindow(open_settings(d), ConversationStore(d / "conversations"),
                       EngineSource(connect=url, link_options=FAST), data_dir=d)
        windows.append(w)
        w.resize(1400, 900)
        w.show()
        w.start_engine()
        assert wait_until(lambda: w.state != "starting", 30, QApplication.instance())
        assert w.state in ("ready", "busy"), (w.state, w.last_error)
        return w

    yield make
    for w in windows:
        w.shutdown()
        w.close()


def _plain(html: str) -> str:
    return re.sub(r"<[^>]+>", "", html)


def test_both_pools_the_transfer_strip_and_per_engine_charts(fake, window):
    win = window(fake.url)
    view = win.remote.disagg
    assert wait_until(lambda: all(h.frames.n == N for h in view.histories.values()), 30,
                      QApplication.instance())
    win.redraw_now()
    assert win.kv_stack.currentWidget() is view.panel
    assert win.chart_stack.currentWidget() is view.charts

    # transfer, decode snapshots 2 -> 12 (10 s): 125 blocks, 125 x 64,000 B, 10 pulls taking
    # 0.25 s, 2 failures; all time 30 pulls in 10.25 s = 341.7 ms each
    assert {k: v.text() for k, v in view.panel.strip.values.items()} == {
        "blocks_per_s": "12.5", "mb_per_s": "0.800", "pull_ms": "25.0 ms",
        "pull_ms_total": "342 ms", "pulls": "30", "pending": "3", "failures": "5 · 2 in 10 s",
        "leases": "2 · 1", "cached": "40 blocks",
    }  # fmt: skip

    # each pool under its engine's name, counted from the block states sent
    prefill, decode = view.panel.pools["prefill"], view.panel.pools["decode"]
    assert _plain(prefill.header.text()) == ("prefill engine · pool 80 blocks × 16 tokens · 8 in "
                                             "use (3 leased to decode) · 12 cached · 60 empty")
    assert _plain(decode.header.text()) == ("decode engine · pool 100 blocks × 16 tokens · 10 in "
                                            "use · 30 cached · 60 empty")
    # the leased blocks are drawn as held (one colour of their own), not as empty ones
    colours = prefill.map.colour_index
    assert len(set(colours[5:8])) == 1 and colours[5] >= REQ0 and colours[5] != colours[0]
    assert (colours[8:20] == CACHED).all() and (colours[20:] == EMPTY).all()
    assert (decode.map.colour_index[10:40] == CACHED).all()

    # per-engine charts: prefill 1,600 prompt / 10 generated tokens over 10 s, decode 160 / 400
    titles = view.charts.titles
    assert titles["prefill.tps"] == "prefill · tok/s: prompt 160 · generation 1.0"
    assert titles["decode.tps"] == "decode · tok/s: prompt 16.0 · generation 40.0"
    assert titles["prefill.req"] == "prefill · requests: running 1 · waiting 2"
    assert titles["decode.req"] == "decode · requests: running 2 · waiting 0"
    assert titles["prefill.kv"] == "prefill · KV % of pool: in use 10 · cached 15"
    assert titles["decode.kv"] == "decode · KV % of pool: in use 10 · cached 30"
    assert titles["transfer.mb"] == "KV pulled: 0.800 MB/s · 12.5 blocks/s"
    assert titles["transfer.ms"] == "transfer per request: 25.0 ms · all time 342 ms"
    # the curves hold one point per snapshot, on each engine's own clock from 0 s
    x, y = view.charts.items["decode.gtps"].getData()
    np.testing.assert_array_equal(x, np.arange(N, dtype=float))
    assert y[-1] == pytest.approx(40.0)
    x, y = view.charts.items["transfer.pending"].getData()
    np.testing.assert_array_equal(y, np.array(PENDING, float))

    assert win.state == "busy"
    assert "prefill 1 running, 2 waiting · decode 2 running, 0 waiting" in \
        win.status.state_label.text()
    assert "prefill/decode pair at " + fake.url in win.model_label.text()
    assert win.kv_label.text().startswith("prefill 80 + decode 100 blocks × 16 tokens")


def test_an_engine_that_is_down_is_said_and_the_other_is_shown(fake, window):
    fake.down["decode"] = "the model is loading"
    win = window(fake.url)
    view = win.remote.disagg
    assert wait_until(lambda: view.histories["prefill"].frames.n == N
                      and "503" in view.panel.pools["decode"].header.text(), 30,
                      QApplication.instance())
    win.redraw_now()
    line = _plain(view.panel.pools["decode"].header.text())
    assert line == ("decode engine · waiting for its telemetry · down: GET /kvscope/telemetry"
                    "?engine=decode: HTTP 503: the decode engine is not ready: the model is "
                    "loading")
    assert "down" not in view.panel.pools["prefill"].header.text()
    assert view.histories["decode"].frames.n == 0 and not win.banner.isVisible()
    assert win.kv_label.text().startswith("prefill 80 blocks × 16 tokens")
    # the engine comes up: its telemetry flows and the line says so
    del fake.down["decode"]
    assert wait_until(lambda: view.histories["decode"].frames.n == N, 30,
                      QApplication.instance())
    win.redraw_now()
    assert "down" not in view.panel.pools["decode"].header.text()
    # its welcome is fetched again: the status bar counts both pools
    assert wait_until(lambda: win.kv_label.text().startswith("prefill 80 + decode 100 blocks"),
                      30, QApplication.instance())
    assert view.panel.strip.values["blocks_per_s"].text() == "12.5"


def test_a_pair_that_comes_back_as_another_server_is_watched_as_that(fake, window):
    win = window(fake.url)
    view = win.remote.disagg
    assert wait_until(lambda: view.histories["decode"].frames.n == N, 30, QApplication.instance())
    fake.stop()
    other = FakeServer("vllm", fixture_texts("vllm_v1"))
    other.port = fake.port  # the same URL, another server behind it
    with other:
        assert wait_until(lambda: win.kv_stack.currentWidget() is win.kv_aggregate, 30,
                          QApplication.instance()), (win.state, win.banner.text.text())
        assert win.chart_stack.currentWidget() is win.metric_charts and not view.active
        assert "vLLM" in win.model_label.text() and win.state in ("ready", "busy")


def test_one_engine_that_comes_back_as_a_pair_is_watched_as_a_pair(fake, window):
    fake.single = True
    win = window(fake.url)
    assert wait_until(lambda: win.history.frames.n == N, 30, QApplication.instance())
    assert win.kv_stack.currentWidget() is win.kv_tabs and not win.remote.disagg.active
    fake.stop()
    fake.single = False  # restarted as a prefill/decode pair on the same port
    fake.welcomes["decode"] = welcome("decode", 100, client_id="decode-2")
    with fake:
        view = win.remote.disagg
        assert wait_until(lambda: view.histories["prefill"].frames.n == N
                          and view.histories["decode"].frames.n == N, 30,
                          QApplication.instance()), (win.state, win.banner.text.text())
        assert win.kv_stack.currentWidget() is view.panel and win.state in ("ready", "busy")
