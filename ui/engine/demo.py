"""`python -m app --demo`: the whole window driven by ui.engine.synthetic instead of an engine.

`DemoLink` has EngineLink's signals and methods, runs on a GUI-thread QTimer (no sockets, no
process) and answers chat requests with canned text, so every panel can be tried without torch.
"""

from __future__ import annotations

import random
import time

from PySide6.QtCore import QObject, QTimer, Signal

from ipc import protocol as P
from ui.engine.synthetic import SyntheticEngine
from ui.telemetry import Frame

_REPLY = ("Paged attention stores each sequence's keys and values in fixed-size blocks, so memory "
          "is allocated on demand and shared prefixes can point at the same physical blocks. "
          "This is a synthetic demo reply; start KVScope without --demo to talk to a model.")


class DemoLink(QObject):
    connected = Signal(object)
    connect_failed = Signal(str)
    replies = Signal(list)
    frames = Signal(list)
    control_reply = Signal(object)
    load_stats = Signal(dict)
    stalled = Signal(str)
    recovered = Signal()
    goodbye = Signal(str)
    finished = Signal()

    def __init__(self, *args, hz: float = 20.0, **kwargs) -> None:
        super().__init__()
        self.engine = SyntheticEngine(num_blocks=600)
        self.rng = random.Random(1)
        self.timer = QTimer(self)
        self.timer.setInterval(int(1000 / hz))
        self.timer.timeout.connect(self._tick)
        self.chats: dict[str, list[str]] = {}
        self.load: int = 0
        self._cid = 0

    def start(self) -> None:
        e = self.engine
        info = e.model_info()
        w = P.Welcome(protocol_version=P.PROTOCOL_VERSION, client_id="demo",
                      model=P.ModelInfo(**info), config=P.LiveConfig(**e.config),
                      pub_endpoint="demo://", telemetry_hz=20.0, heartbeat_interval=1.0,
                      client_timeout=10.0, max_message_bytes=1 << 20, server_time=e.t)
        QTimer.singleShot(0, lambda: self.connected.emit(w))
        self.timer.start()

    def stop(self, timeout: float = 0.0) -> None:
        self.timer.stop()

    def generate(self, request_id: str, messages: list, sampling: dict) -> None:
        self.engine.add(prompt=40 + 8 * len(messages), max_out=int(sampling.get("max_tokens", 64)),
                        origin="gui")
        self.chats[request_id] = _REPLY.split(" ")[: int(sampling.get("max_tokens", 64))]

    def tokenize(self, request_id: str, text: str) -> bool:
        """No tokenizer in the demo: no answer, and False tells the caller to estimate."""
        return False

    def abort(self, request_id: str) -> None:
        if request_id in self.chats:
            self.chats.pop(request_id)
            self.replies.emit([self._finish(request_id, "abort", 0)])

    def control(self, op: str, **fields) -> str:
        self._cid += 1
        if op == "set_limits":
            limits = {k: v for k, v in fields.items() if v is not None}
            if limits.pop("default_prefill_chunk", False):  # the engine's rule: 512 beside others
                limits |= {"long_prefill_chunk": 512, "long_prefill_chunk_default": True}
            elif "long_prefill_chunk" in limits:
                limits["long_prefill_chunk_default"] = False
            self.engine.config.update(limits)
        elif op == "set_prefix_caching":
            self.engine.config["enable_prefix_caching"] = bool(fields["enable_prefix_caching"])
        elif op == "reset_prefix_cache":
            self.engine.flush_prefix_cache()
        self.control_reply.emit(P.ControlAck(control_id=f"demo-{self._cid}", op=op,
                                             config=P.LiveConfig(**self.engine.config),
                                             time=self.engine.t,
                                             result=True if op == "reset_prefix_cache" else None))
        return f"demo-{self._cid}"

    def start_load(self, config) -> None:
        self.load = config.concurrency

    def stop_load(self) -> None:
        self.load = 0

    def _finish(self, rid: str, reason: str, n: int) -> P.Finish:
        return P.Finish(request_id=rid, index=0, reason=reason,
                        usage=P.Usage(prompt_tokens=48, cached_tokens=32, completion_tokens=n),
                        ttft=0.05, tpot=0.03, e2e=0.05 + 0.03 * n)

    def _tick(self) -> None:
        e = self.engine
        if len(e.running) + len(e.waiting) < self.load:
            e.add()
        e.step()
        out = []
        for rid, words in list(self.chats.items()):
            if words:
                out.append(P.Delta(request_id=rid, index=0, token_ids=[1], text=words.pop(0) + " ",
                                   token_times=[time.monotonic()], time=time.monotonic()))
            else:
                self.chats.pop(rid)
                out.append(self._finish(rid, "stop", 40))
        if out:
            self.replies.emit(out)
        self.frames.emit([Frame.from_wire(e.snapshot())])
        if self.load:
            self.load_stats.emit({"in_flight": len(e.running) + len(e.waiting),
                                  "finished": int(e.c["num_requests_finished"]),
                                  "generated_tokens": int(e.c["generation_tokens_total"])})
