"""`python -m ui.kv.prefix_tree_bench [--blocks 20000] [--seconds 20]`: the Prefix tree panel's cost
on the GUI thread with a large prefix cache, the way the window runs it: a synthetic tree of
shared prompts with many branches changes every step, a worker thread applies the event
batches and lays the tree out (at most twice a second), the GUI thread takes each layout and
redraws at 10 Hz with telemetry frames at 20 Hz. Prints the event-loop latency percentiles
(ui/latency.py) and the panel's handler times. Offscreen when no display is set."""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import threading
import time

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ui.kv.prefix_tree_bench")
    ap.add_argument("--blocks", type=int, default=20_000)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--png", default=None, help="save the panel to this PNG at the end")
    args = ap.parse_args(argv)
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6.QtCore import QObject, QTimer, Signal
    from PySide6.QtWidgets import QApplication

    from ipc import kv_events as K
    from ui.kv.prefix_tree import PrefixTreePanel
    from ui.kv.prefix_tree_layout import TreeTracker
    from ui.latency import LatencyProbe
    from ui.qt_compat import collect_garbage_on_gui_thread
    from ui.telemetry import BLOCK_CACHED, BLOCK_IN_USE, Frame

    app = QApplication.instance() or QApplication([])
    collect_garbage_on_gui_thread()  # as the app does (ui.qt_compat)
    panel = PrefixTreePanel()
    panel.resize(900, 360)
    panel.show()
    bs, n = 16, args.blocks
    rng = random.Random(0)

    def h(i: int) -> bytes:
        return hashlib.sha256(i.to_bytes(8, "little")).digest()

    # 50 system prompts of 8 blocks, then branches of 1-12 blocks off random prompt nodes
    events: list[K.KVEventWire] = []
    parent_of: dict[int, int | None] = {}
    next_id = 0
    for _ in range(50):
        prev = None
        for _ in range(8):
            parent_of[next_id] = prev
            prev, next_id = next_id, next_id + 1
    while next_id < n:
        prev = rng.randrange(next_id)
        for _ in range(rng.randrange(1, 13)):
            if next_id >= n:
                break
            parent_of[next_id] = prev
            prev, next_id = next_id, next_id + 1
    for i, p in parent_of.items():
        events.append(K.BlockStored(block_hashes=[h(i)], parent_block_hash=None if p is None
                                    else h(p), token_ids=[i % 1000] * bs, block_size=bs,
                                    block_ids=[i]))

    class Bridge(QObject):
        layout = Signal(object, bool)

    bridge = Bridge()
    bridge.layout.connect(panel.set_layout)
    tracker = TreeTracker()
    tracker.wanted = True
    stop = threading.Event()
    t_layout: list[float] = []

    def worker() -> None:  # the engine link's role: batches in, layouts out
        seq = 1
        tracker.on_batch(K.KVEventBatch(seq=seq, time=0.0, events=events))
        victim = 0
        while not stop.is_set():
            seq += 1  # each step: one old leaf evicted, one new block stored
            batch = K.KVEventBatch(seq=seq, time=0.0, events=[
                K.BlockRemoved(block_hashes=[h(n + victim - 1)]) if victim else
                K.AllBlocksCleared(medium="host"),
                K.BlockStored(block_hashes=[h(n + victim)], parent_block_hash=h(victim % n),
                              token_ids=[7] * bs, block_size=bs, block_ids=[victim % n]),
            ])  # fmt: skip
            victim += 1
            tracker.on_batch(batch)
            t0 = time.perf_counter()
            lay = tracker.maybe_layout(time.monotonic())
            if lay is not None:
                t_layout.append(time.perf_counter() - t0)
                bridge.layout.emit(lay, True)
            time.sleep(0.05)

    state = np.full(n, BLOCK_CACHED, np.uint8)

    def frame() -> None:
        state[:] = BLOCK_CACHED
        state[rng.sample(range(n), 400)] = BLOCK_IN_USE
        panel.set_frame(Frame(time=time.monotonic(), state=state.copy(),
                              ref_count=(state == BLOCK_IN_USE).astype(np.int32),
                              filled=np.full(n, bs, np.int32), short_hash=np.zeros(n, np.uint32),
                              parent=np.full(n, -1, np.int32), requests=[],
                              counters={"block_size": bs}, config={}))  # fmt: skip

    redraws: list[float] = []

    def redraw() -> None:
        t0 = time.perf_counter()
        panel.redraw()
        redraws.append(time.perf_counter() - t0)

    timers = []
    for period, fn in ((50, frame), (100, redraw)):
        t = QTimer()
        t.timeout.connect(fn)
        t.start(period)
        timers.append(t)
    threading.Thread(target=worker, daemon=True).start()
    probe = LatencyProbe()
    probe.start()
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        app.processEvents()
        time.sleep(0.001)
    probe.stop()
    stop.set()
    if args.png:
        panel.redraw(force=True)
        app.processEvents()
        panel.grab().save(args.png)
    r = probe.result()
    print(f"prefix tree panel, {n:,} cached blocks, {args.seconds:.0f} s: event-loop latency "
          f"p50 {r['p50']:.1f} ms  p99 {r['p99']:.1f} ms  max {r['max']:.1f} ms (target p99 < 50)")
    red = np.asarray(redraws) * 1e3
    lay = np.asarray(t_layout) * 1e3
    print(f"  redraw (GUI thread): {len(red)} calls, mean {red.mean():.1f} ms, p99 "
          f"{np.percentile(red, 99):.1f} ms; layout (worker thread): {len(lay)} layouts, mean "
          f"{lay.mean():.0f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
