"""The window's headless extras (`python -m app --screenshot` / `--measure-latency`): run the
real window, under a synthetic load when asked, then save a PNG or print the GUI event-loop
latency (and, with --measure-reply, a chat reply's speed alone and under the load)."""

from __future__ import annotations

import gc
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path


def when_ready(win, fn) -> None:
    from PySide6.QtCore import QTimer

    def check() -> None:
        if win.state in ("ready", "busy"):
            timer.stop()
            fn()

    timer = QTimer(win)
    timer.timeout.connect(check)
    timer.start(100)


def start_load(win, n: int, max_tokens: int = 96) -> None:
    from app.load_generator import LoadConfig

    lo = max(1, max_tokens // 6)
    cfg = LoadConfig(
        concurrency=n,
        system_prompt_tokens=win.load_panel.system_tokens.value(),
        min_output_tokens=lo,
        max_output_tokens=max(lo, max_tokens),
    )
    lp = win.load_panel
    lp.concurrency.setValue(n)
    lp.min_out.setValue(cfg.min_output_tokens)
    lp.max_out.setValue(cfg.max_output_tokens)
    win.start_load(cfg)


def screenshot(app, win, out: Path, args) -> int:
    from ui.window.main_window import wait_until

    try:
        if not wait_until(
            lambda: win.state in ("ready", "busy", "disconnected"), args.timeout, app
        ):
            print("screenshot: the engine did not become ready in time", file=sys.stderr)
        if win.state in ("ready", "busy"):
            wait_until(lambda: False, 1.0, app)  # let the telemetry subscription join first
            chat = win.chat
            if not chat.current.messages:
                chat.input.setPlainText("In two sentences: what is a paged KV cache?")
                chat.send_current()
            if args.load:
                start_load(win, args.load, args.load_max_tokens)
            wait_until(lambda: False, args.settle, app)
            reqs = win.history.latest.requests if win.history.latest else []
            if chat.current is not None and chat.busy():
                pass  # the conversation's own request is highlighted already
            elif reqs:
                win.block_map.highlight_request(reqs[0].request_id)
        app.processEvents()
        win.redraw_now()
        app.processEvents()
        out.parent.mkdir(parents=True, exist_ok=True)
        ok = win.grab().save(str(out))
        print(f"screenshot: {out} ({'ok' if ok else 'FAILED'}, engine {win.state})")
        return 0 if ok else 1
    finally:
        win.shutdown()
        win.close()


def measure(app, win, args) -> int:
    from ui.latency import LatencyProbe
    from ui.window.main_window import wait_until

    try:
        if not wait_until(lambda: win.state in ("ready", "busy"), args.timeout, app):
            print("measure-latency: the engine did not become ready", file=sys.stderr)
            return 1
        # baseline: the same machine and window, engine connected, no load
        probe = LatencyProbe()
        probe.start()
        run_loop_for(app, 3.0)
        probe.stop()
        base = probe.result()
        alone = timed_reply(app, win, args.measure_reply, args.timeout) if args.measure_reply \
            else None  # fmt: skip
        if args.load:
            start_load(win, args.load, args.load_max_tokens)
        wait_until(lambda: False, 2.0, app)  # let the load ramp up
        probe = LatencyProbe()
        for d in win.perf.values():
            d.clear()
        gc_pauses = track_gc_pauses(win.perf)
        probe.start()
        frames0 = win._frames_seen
        generated0 = load_generated(win)
        cpu0 = time.process_time()
        t0 = time.monotonic()
        run_loop_for(app, args.measure_latency)
        probe.stop()
        gc.callbacks.remove(gc_pauses)
        el = time.monotonic() - t0
        cpu = (time.process_time() - cpu0) / el
        r = probe.result()
        hz = (win._frames_seen - frames0) / el
        print(
            f"GUI event-loop latency over {el:.1f} s, load {args.load} chats, telemetry "
            f"{hz:.1f} Hz received, redraw {args.refresh_hz:g} Hz:"
        )
        print(
            f"  under load: samples {r['n']}  p50 {r['p50']:.1f} ms  p90 {r['p90']:.1f} ms  "
            f"p99 {r['p99']:.1f} ms  max {r['max']:.1f} ms  (target p99 < 50 ms)"
        )
        print(
            f"  idle baseline (3 s, no load): p50 {base['p50']:.1f} ms  p99 {base['p99']:.1f} ms"
            f"  max {base['max']:.1f} ms"
        )
        import numpy as np

        for name, d in win.perf.items():
            if d:
                a = np.asarray(d) * 1e3
                capped = getattr(d, "maxlen", None) == len(a)  # a deque keeps the last N only
                busy = (
                    f"the last {len(a):,} calls"
                    if capped
                    else f"{len(a)} calls, busy {a.sum() / el / 10:.1f}% of the time"
                )
                print(
                    f"  GUI handler '{name}': mean {a.mean():.1f} ms, p99 "
                    f"{np.percentile(a, 99):.1f} ms over {busy}"
                )
        print(
            f"  GUI process CPU: {cpu * 100:.0f}% of one core (all its threads); machine load "
            f"average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
        )
        if win.load_panel.stats.text():
            print(f"  load generator: {win.load_panel.stats.text()}")
            rate = (load_generated(win) - generated0) / el
            print(f"  load chats: {rate:.1f} tok/s generated over the {el:.0f} s window")
        if alone is not None:
            print_reply("reply alone", alone)
            print_reply(f"reply under load {args.load}",
                        timed_reply(app, win, args.measure_reply, args.timeout))  # fmt: skip
        return 0
    finally:
        win.shutdown()
        win.close()


def track_gc_pauses(perf: dict) -> Callable[[str, dict], None]:
    """Time the garbage collector's passes (any thread's) into perf['gc gen N']."""
    started: list[float] = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[:] = [time.perf_counter()]
        elif started:
            perf.setdefault(f"gc gen {info['generation']}", []).append(
                time.perf_counter() - started[0]
            )

    gc.callbacks.append(on_gc)
    return on_gc


def run_loop_for(app, seconds: float) -> None:
    from PySide6.QtCore import QEventLoop, QTimer

    loop = QEventLoop()
    QTimer.singleShot(int(seconds * 1000), loop.quit)
    loop.exec()



REPLY_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def timed_reply(app, win, max_tokens: int, timeout: float) -> dict:
    """A greedy chat reply sent from the panel as a person would, timed by the engine (its
    tok/s and TTFT, in the reply's stats), with the event loop's latency while it streamed."""
    from ui.latency import LatencyProbe
    from ui.window.main_window import wait_until

    chat = win.chat
    chat.temperature.setValue(0.0)
    chat.max_tokens.setValue(max_tokens)
    conv = chat.new_conversation()
    chat.input.setPlainText(REPLY_PROMPT)
    if chat.send_current() is None:
        return {}
    probe = LatencyProbe()
    probe.start()
    done = wait_until(lambda: not chat.busy(conv.id), timeout, app)
    probe.stop()
    reply = conv.messages[-1]
    return dict(reply.stats) | {"done": done, "latency": probe.result()}


def print_reply(label: str, r: dict) -> None:
    if not r.get("done"):
        print(f"  {label}: did not finish")
        return
    lat = r["latency"]
    tok_s = r.get("tok_s") or 0.0
    ttft = (r.get("ttft") or 0.0) * 1e3
    print(f"  {label}: {r.get('completion_tokens', '?')} tokens at {tok_s:.1f} tok/s (TTFT "
          f"{ttft:.0f} ms); event loop meanwhile p50 {lat['p50']:.1f} ms  p99 {lat['p99']:.1f} "
          f"ms  max {lat['max']:.1f} ms")


def load_generated(win) -> int:
    """Tokens the load chats have generated so far (the load panel's counter)."""
    import re

    m = re.search(r"generated ([\d,]+) tok", win.load_panel.stats.text())
    return int(m.group(1).replace(",", "")) if m else 0
