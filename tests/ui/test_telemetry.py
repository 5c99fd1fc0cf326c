"""ui.telemetry: wire decoding and the chart series, against brute-force recomputation."""

from __future__ import annotations

import math

import numpy as np

from ipc import protocol as P
from ui.engine.synthetic import SyntheticEngine
from ui.telemetry import BLOCK_CACHED, BLOCK_IN_USE, Frame, History


def _wire(snap: dict, seq: int = 0) -> P.Telemetry:
    """The synthetic snapshot as the engine would publish it, through msgpack and back."""
    b = snap["blocks"]
    msg = P.Telemetry(
        seq=seq, time=snap["time"], counters=snap["counters"],
        config=P.LiveConfig(**snap["config"]),
        blocks=P.BlockArrays.pack(**b),
        requests=[P.RequestState(**r) for r in snap["requests"]],
        token_events=[P.TokenEvent(request_id=r, index=i, time=t)
                      for r, i, t in snap["token_events"]],
        steps=[P.StepStats(time=s[0], duration=s[1], num_prefill_tokens=s[2],
                           num_decode_tokens=s[3], num_running=s[4], num_waiting=s[5])
               for s in snap["steps"]],
    )
    return P.decode_pub(P.encode(msg))


def test_frame_from_wire_matches_the_snapshot():
    eng = SyntheticEngine(num_blocks=97, seed=3)
    for i in range(60):
        if i % 4 == 0:
            eng.add()
        eng.step()
    snap = eng.snapshot()
    f = Frame.from_wire(_wire(snap))
    for name in ("state", "ref_count", "filled", "short_hash", "parent"):
        np.testing.assert_array_equal(getattr(f, name), snap["blocks"][name])
    assert f.num_blocks == 97
    assert [r.request_id for r in f.requests] == [r["request_id"] for r in snap["requests"]]
    assert f.config["max_num_seqs"] == snap["config"]["max_num_seqs"]
    assert f.token_events == [tuple(e) for e in snap["token_events"]]
    # owners: every live request's table, inverted by hand
    expect: dict[int, set[str]] = {}
    for r in snap["requests"]:
        for b in r["block_table"]:
            expect.setdefault(b, set()).add(r["request_id"])
    assert {b: set(v) for b, v in f.owners().items()} == expect
    # shared blocks are exactly those with several owners
    shared = {b for b in expect if f.ref_count[b] > 1}
    assert shared == {b for b, v in expect.items() if len(v) > 1}


def test_history_rates_and_latencies_match_brute_force():
    eng = SyntheticEngine(num_blocks=256, seed=1)
    h = History(window_s=2.0)
    frames, events, arrivals = [], [], {}
    for i in range(300):
        if i % 5 == 0:
            eng.add()
        eng.step()
        if i % 3 == 0:
            snap = eng.snapshot()
            for r in snap["requests"]:
                arrivals[r["request_id"]] = r["arrival_time"]
            events += snap["token_events"]
            f = Frame.from_wire(snap)
            frames.append(f)
            h.add(f)
    # hit rate: counter deltas between the newest frame and the oldest one inside the window
    last = frames[-1]
    inside = [f for f in frames if last.time - f.time < h.window_s + 1e-9]
    first = next(f for f in frames if last.time - f.time <= h.window_s + 0.1 and f in inside)
    dq = last.counters["prefix_cache_queries"] - first.counters["prefix_cache_queries"]
    dk = last.counters["prefix_cache_hits"] - first.counters["prefix_cache_hits"]
    assert dq > 0
    assert abs(h.rates.hit_rate - dk / dq) < 0.05
    dt = last.time - first.time
    dg = last.counters["generation_tokens_total"] - first.counters["generation_tokens_total"]
    assert math.isclose(h.rates.gen_tps, dg / dt, rel_tol=0.1)
    # inter-token latencies: consecutive token times per request, computed independently
    itl = []
    prev: dict[str, float] = {}
    for rid, idx, t in sorted(events, key=lambda e: e[2]):
        if idx > 0 and rid in prev:
            itl.append(t - prev[rid])
        prev[rid] = t
    got = h.itl.view()[:, 1]
    assert len(got) == len(itl)
    np.testing.assert_allclose(np.sort(got), np.sort(itl))
    # KV split of the last frame sums to the pool
    row = h.frames.view()[-1]
    assert math.isclose(row[History.IN_USE] + row[History.CACHED] + row[History.EMPTY], 1.0)
    n = last.num_blocks
    assert math.isclose(row[History.IN_USE], np.count_nonzero(last.state == BLOCK_IN_USE) / n)
    assert math.isclose(row[History.CACHED], np.count_nonzero(last.state == BLOCK_CACHED) / n)


def test_history_restarts_on_a_new_engine_clock():
    eng = SyntheticEngine(num_blocks=32)
    h = History()
    eng.add()
    for _ in range(5):
        eng.step()
        h.add(Frame.from_wire(eng.snapshot()))
    assert len(h.frames) == 5
    eng2 = SyntheticEngine(num_blocks=32)
    eng2.t = 1.0  # a restarted engine: its monotonic clock is behind the old one
    eng2.step()
    h.add(Frame.from_wire(eng2.snapshot()))
    assert len(h.frames) == 1


def test_hits_from_lower_kv_tiers_are_their_own_series():
    """external_prefix_cache_hits (tokens the host/disk tiers served) over the same window's
    prefix-cache queries; NaN, and no points drawn, from an engine without tiers."""
    eng = SyntheticEngine(num_blocks=64, seed=2)
    h = History(window_s=5.0)
    eng.add()
    eng.step()
    snap = eng.snapshot()
    base = dict(snap["counters"])
    for i, (queries, hits, tier_hits) in enumerate([(0, 0, 0), (100, 60, 10), (300, 200, 70)]):
        f = Frame.from_wire(snap)
        f.time = float(i)
        f.counters = base | {"prefix_cache_queries": queries, "prefix_cache_hits": hits,
                             "external_prefix_cache_hits": tier_hits}
        h.add(f)
    assert math.isclose(h.rates.hit_rate, 200 / 300)
    assert math.isclose(h.rates.tier_hit_rate, 70 / 300)
    assert math.isclose(h.frames.view()[-1, History.TIER_HIT], 70 / 300)
    plain = History(window_s=5.0)
    for i in range(3):
        f = Frame.from_wire(snap)
        f.time = float(i)
        plain.add(f)
    assert math.isnan(plain.rates.tier_hit_rate)
