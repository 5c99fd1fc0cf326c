"""How a streaming reply costs the GUI: a shown ChatPanel holding a long Markdown-rich
conversation streams one more reply at a steady token rate while a probe measures the event loop's
latency (ui/latency.py: how long an event posted to the GUI thread waits).

    python -m ui.chat.bench_stream --messages 500 --rate 100 --seconds 10 [--plain | --both]

`--plain` times the plain-text view replies had before Markdown (message_view.MARKDOWN = False);
`--both` runs plain, then Markdown, in this one process. A benchmark, not a test: numbers only.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PySide6.QtCore import QEventLoop, Qt, QTimer
from PySide6.QtWidgets import QApplication

import ui  # noqa: F401  (the PySide6 refcount workaround, before any Qt object)
from app.conversations import Conversation, ConversationStore, Message
from app.settings import SamplingDefaults
from ipc import protocol as P
from ui import theme
from ui.chat import message_view
from ui.chat.message_view import MessageView
from ui.chat.panel import ChatPanel
from ui.latency import LatencyProbe
from ui.qt_compat import collect_garbage_on_gui_thread

CHARS_PER_TOKEN = 4
REPLY = """Here is how the **paged KV cache** works, step by step:

1. The prompt is split into *blocks* of 16 tokens.
2. Each full block is hashed with its prefix, so equal prefixes share blocks.
   - a hit skips the prefill of that block
   - a miss computes it and caches it
3. Free blocks keep their hash until they are evicted.

| block | tokens | ref count | state |
|------:|-------:|----------:|:------|
| 0 | 16 | 2 | shared |
| 1 | 16 | 1 | in use |
| 2 | 7 | 1 | partial |

> Evicting least-recently-used blocks first keeps hot prefixes resident.

```python
def allocate(pool: list[int], n: int) -> list[int]:
    \"\"\"Take n free blocks, oldest first.\"\"\"
    if len(pool) < n:
        raise MemoryError(f"need {n} blocks, {len(pool)} free")
    taken, pool[:] = pool[:n], pool[n:]
    return taken
```

Call it with `allocate(free, 3)`; see [the vLLM paper](https://arxiv.org/abs/2309.06180).

```js
const hit = (cached, total) => total ? cached / total : 0;
console.log(`hit rate ${hit(32, 45).toFixed(2)}`);
```
"""


@dataclass(slots=True)
class Result:
    mode: str
    build_s: float
    lat: np.ndarray  # event-loop latency samples, ms
    renders: int  # renders of the streaming reply, the final one (after Finish) included
    other_renders: int  # renders of every other message while it streamed (want 0)
    deltas: int
    finish_ms: float  # the final, exact render after Finish

    def line(self) -> str:
        p = np.percentile(self.lat, [50, 95, 99]) if self.lat.size else [0.0] * 3
        return (f"{self.mode:8s} build {self.build_s:5.2f} s | latency ms p50 {p[0]:5.2f} "
                f"p95 {p[1]:6.2f} p99 {p[2]:6.2f} max {self.lat.max():6.2f} (n={self.lat.size})"
                f" | renders {self.renders} for {self.deltas} deltas, others {self.other_renders}"
                f" | final render {self.finish_ms:.1f} ms")


def history(n_messages: int) -> Conversation:
    conv = Conversation(title="bench: long Markdown conversation")
    for i in range(n_messages // 2):
        conv.append(Message("user", f"Question {i}: how does block {i} get cached?"))
        conv.append(Message("assistant", REPLY.replace("block 0", f"block {i}"),
                                     stats={"ttft": 0.1, "tok_s": 30.0, "finish_reason": "stop"}))
    return conv


def stream_text(rate: float, seconds: float) -> str:
    need = int(rate * seconds * CHARS_PER_TOKEN) + 1
    return (REPLY * (need // len(REPLY) + 1))[:need]


def spin(seconds: float) -> None:
    """Run the event loop for a while (lay out, paint, fire timers)."""
    loop = QEventLoop()
    QTimer.singleShot(int(seconds * 1000), loop.quit)
    loop.exec()


class Streamer:
    """Feeds the panel Deltas at `rate` tokens/s from a precise timer, as the engine link would."""

    def __init__(self, panel: ChatPanel, rid: str, text: str, rate: float) -> None:
        self.panel, self.rid, self.text, self.rate = panel, rid, text, rate
        self.sent_tokens = 0
        self.deltas = 0
        self.t0 = time.perf_counter()
        self.timer = QTimer()
        self.timer.setTimerType(Qt.TimerType.PreciseTimer)
        self.timer.setInterval(max(1, int(1000 / rate)))
        self.timer.timeout.connect(self._tick)
        self.timer.start()

    def _tick(self) -> None:
        due = int((time.perf_counter() - self.t0) * self.rate) - self.sent_tokens
        if due <= 0:
            return
        a = self.sent_tokens * CHARS_PER_TOKEN
        chunk = self.text[a:a + due * CHARS_PER_TOKEN]
        self.sent_tokens += due
        self.deltas += 1
        self.panel.on_replies([P.Delta(request_id=self.rid, index=0, token_ids=[1] * due,
                                       text=chunk, token_times=[0.0] * due, time=0.0)])

    def finish(self) -> float:
        self.timer.stop()
        t = time.perf_counter()
        usage = P.Usage(prompt_tokens=100, cached_tokens=96, completion_tokens=self.sent_tokens)
        self.panel.on_replies([P.Finish(request_id=self.rid, index=0, reason="stop", ttft=0.1,
                                        tpot=1 / self.rate, e2e=1.0, usage=usage)])
        return (time.perf_counter() - t) * 1000.0


def run(markdown: bool, args: argparse.Namespace) -> Result:
    message_view.MARKDOWN = markdown
    with tempfile.TemporaryDirectory() as tmp:
        store = ConversationStore(Path(tmp))
        store.save(history(args.messages))
        t0 = time.perf_counter()
        panel = ChatPanel(store, SamplingDefaults(temperature=0.0, max_tokens=4096))
        panel.resize(1100, 850)
        panel.show()
        QApplication.processEvents()
        build_s = time.perf_counter() - t0
        spin(1.0)  # settle: every message laid out once at its real width
        panel.set_engine_ready(True)
        panel.input.setPlainText("And how does eviction work?")
        rid = panel.send_current()
        assert rid is not None
        reply = panel.current.messages[-1]
        views = panel.findChildren(MessageView)
        mine = next(v for v in views if v.msg is reply)
        before = {v: v.render_count for v in views}
        probe = LatencyProbe(period_ms=5.0)
        probe.start()
        streamer = Streamer(panel, rid, stream_text(args.rate, args.seconds), args.rate)
        spin(args.seconds)
        probe.stop()
        finish_ms = streamer.finish()
        others = sum(v.render_count - n for v, n in before.items() if v is not mine)
        result = Result("markdown" if markdown else "plain", build_s, np.asarray(probe.samples),
                        mine.render_count - before[mine], others, streamer.deltas, finish_ms)
        panel.close()
        panel.deleteLater()
        spin(0.2)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=500)
    ap.add_argument("--rate", type=float, default=100.0, help="tokens per second")
    ap.add_argument("--seconds", type=float, default=10.0)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--plain", action="store_true", help="the old plain-text replies")
    mode.add_argument("--both", action="store_true", help="plain, then Markdown, one process")
    args = ap.parse_args(argv)
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")  # no display needed; xvfb-run works too
    app = QApplication.instance() or QApplication(sys.argv[:1])
    collect_garbage_on_gui_thread()  # as the app does (ui.qt_compat)
    theme.apply_dark_theme(app)
    modes = [False, True] if args.both else [not args.plain]
    print(f"{args.messages} messages, {args.rate:g} tokens/s for {args.seconds:g} s, "
          f"~{CHARS_PER_TOKEN} chars a token, platform {QApplication.platformName()}")
    for markdown in modes:
        print(run(markdown, args).line(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
