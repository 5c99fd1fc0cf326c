"""`python -m ui.remote.bench_kv_events [--blocks 100000] [--seconds 30]`: what following a big
server's KV events costs the GUI thread. A publisher process speaking vLLM's format (map
events, 64-bit int hashes, a PUB and a replay ROUTER like vLLM's `ZmqEventPublisher`) stores
`--blocks` blocks as fast as it can (50 system prompts of 8 blocks, then conversations of 1 to
12 blocks on them, one batch per request), then keeps changing the cache (one eviction and one
store per 20 ms). The window's parts do what they do in the window: the subscriber thread
(ui/remote/kv_events_link.py), the GUI timer applying chunks within its budget and the layout
thread (ui/remote/remote_tree.py), the Prefix tree panel redrawing at 10 Hz. Prints the GUI
event loop's latency (ui/latency.py) over the whole run, how long the blocks took to arrive
and to be drawn, and each handler's time. Offscreen when no display is set."""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import time

import numpy as np

BS = 16


def _plan(n: int, seed: int = 0) -> list[tuple[list[int], int | None]]:
    """Requests as (block ids of the new chain, id of its parent block or None)."""
    rng = random.Random(seed)
    out: list[tuple[list[int], int | None]] = []
    next_id = 0
    for _ in range(50):
        out.append((list(range(next_id, next_id + 8)), None))
        next_id += 8
    while next_id < n:
        k = min(rng.randrange(1, 13), n - next_id)
        out.append((list(range(next_id, next_id + k)), rng.randrange(next_id)))
        next_id += k
    return out


def _publish(port_q, n: int, seconds: float) -> None:
    """The publisher process: binds, says where, stores `n` blocks, then churns."""
    import collections
    import threading

    import msgspec
    import zmq

    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 100_000)  # vLLM's default hwm
    router = ctx.socket(zmq.ROUTER)
    ports = (pub.bind_to_random_port("tcp://127.0.0.1"),
             router.bind_to_random_port("tcp://127.0.0.1"))  # fmt: skip
    buffer: collections.deque = collections.deque(maxlen=100_000)
    lock = threading.Lock()

    def serve() -> None:
        while True:
            client, _, start = router.recv_multipart()
            with lock:
                todo = [(s, p) for s, p in buffer if s >= int.from_bytes(start, "big")]
            for s, p in todo:
                router.send_multipart([client, b"", b"kv", s.to_bytes(8, "big"), p])
            router.send_multipart([client, b"", b"", b"\xff" * 8, b""])

    threading.Thread(target=serve, daemon=True).start()
    time.sleep(0.5)  # let the subscriber join
    port_q.put(ports)
    seq = 0

    def send(events: list[dict]) -> None:
        nonlocal seq
        payload = msgspec.msgpack.encode([time.time(), events, 0])
        with lock:
            buffer.append((seq, payload))
        pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])
        seq += 1

    def stored(ids: list[int], parent: int | None) -> dict:
        return {"type": "BlockStored", "block_hashes": [i + 1 for i in ids],
                "parent_block_hash": None if parent is None else parent + 1,
                "token_ids": [i % 1000 for i in ids for _ in range(BS)], "block_size": BS,
                "lora_id": None, "medium": "GPU", "lora_name": None}  # fmt: skip

    for ids, parent in _plan(n):
        send([stored(ids, parent)])
    end, k = time.monotonic() + seconds, 0
    while time.monotonic() < end:  # one old block out, one new one in
        out = [{"type": "BlockRemoved", "block_hashes": [n + k], "medium": "GPU"}] if k else []
        send(out + [stored([n + k], k % n)])
        k += 1
        time.sleep(0.02)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ui.remote.bench_kv_events")
    ap.add_argument("--blocks", type=int, default=100_000)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--png", default=None, help="save the panel to this PNG at the end")
    args = ap.parse_args(argv)
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6.QtCore import QTimer
    from PySide6.QtWidgets import QApplication

    from app.remote.kv_events_source import KvEventsSource
    from ui.kv.prefix_tree import PrefixTreePanel
    from ui.latency import LatencyProbe
    from ui.qt_compat import collect_garbage_on_gui_thread
    from ui.remote.kv_events_link import KvEventsLink
    from ui.remote.remote_tree import RemoteTreeFeed

    app = QApplication.instance() or QApplication([])
    collect_garbage_on_gui_thread()  # as the app does (ui.qt_compat)
    panel = PrefixTreePanel()
    panel.use_remote(lambda lay, i: "", "waiting")
    panel.resize(900, 360)
    panel.show()
    mp = multiprocessing.get_context("spawn")
    q = mp.Queue()
    proc = mp.Process(target=_publish, args=(q, args.blocks, args.seconds), daemon=True)
    proc.start()
    pub_port, replay_port = q.get(timeout=60)
    link = KvEventsLink([KvEventsSource(f"tcp://127.0.0.1:{pub_port}",
                                        f"tcp://127.0.0.1:{replay_port}")])  # fmt: skip
    feed = RemoteTreeFeed(link)
    feed.wanted = True
    times: dict[str, list[float]] = {"pump": [], "set_layout": [], "redraw": []}
    marks: dict[str, float] = {}
    t_start = time.monotonic()

    def timed(name: str, fn):
        def run(*a) -> None:
            t0 = time.perf_counter()
            fn(*a)
            times[name].append(time.perf_counter() - t0)
        return run

    def on_layout(lay) -> None:
        panel.set_layout(lay, note=f"{lay.num_blocks:,} blocks")
        if lay.num_blocks >= args.blocks and "drawn" not in marks:
            marks["drawn"] = time.monotonic() - t_start

    def pump() -> None:
        feed.pump()
        if len(feed.tree.nodes) >= args.blocks and "applied" not in marks:
            marks["applied"] = time.monotonic() - t_start

    feed.layout_ready.connect(timed("set_layout", on_layout))
    timers = []
    for period, fn in ((30, timed("pump", pump)), (100, timed("redraw", panel.redraw))):
        t = QTimer()
        t.timeout.connect(fn)
        t.start(period)
        timers.append(t)
    link.start()
    probe = LatencyProbe()
    probe.start()
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        app.processEvents()
        time.sleep(0.001)
    probe.stop()
    link.stop()
    proc.terminate()
    _report(args, probe.result(), times, marks, feed, link)
    if args.png:
        panel.redraw(force=True)
        app.processEvents()
        panel.grab().save(args.png)
    return 0


def _report(args, r: dict, times: dict, marks: dict, feed, link) -> None:
    st = next(iter(link.stats().values()))
    print(f"KV events into the prefix tree, {args.blocks:,} blocks, {args.seconds:.0f} s: "
          f"event-loop latency p50 {r['p50']:.1f} ms  p90 {r['p90']:.1f} ms  p99 "
          f"{r['p99']:.1f} ms  max {r['max']:.1f} ms (target p99 < 50 ms)")
    print(f"  all blocks applied after {marks.get('applied', float('nan')):.1f} s, drawn after "
          f"{marks.get('drawn', float('nan')):.1f} s; {st.batches:,} batches, {st.replays} "
          f"replays, {st.lost} lost, {len(feed.tree.nodes):,} blocks in the tree now")
    for name, ts in times.items():
        if ts:
            a = np.asarray(ts) * 1e3
            print(f"  GUI {name}: {len(a)} calls, mean {a.mean():.1f} ms, p99 "
                  f"{np.percentile(a, 99):.1f} ms, max {a.max():.1f} ms")
    lay = feed.layout
    if lay is not None:
        print(f"  layout thread: last layout {feed.layout_seconds * 1e3:.0f} ms for "
              f"{lay.num_blocks:,} blocks, image {lay.owner.shape[0]:,} x {lay.owner.shape[1]}")
    print(f"  machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    raise SystemExit(main())
