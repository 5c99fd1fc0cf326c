"""The GUI's only door to the engine: a worker thread that owns the ZeroMQ sockets.

The worker holds one `ipc.client.EngineConnection` (DEALER for requests and replies, SUB for
telemetry), polls it on a short timeout, drives the load generator, decodes telemetry into
`ui.telemetry.Frame`s, and emits one Qt signal per batch. The GUI thread only calls the methods
below, which put commands on a queue and wake the worker through a pipe: it never touches a socket.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Any

import zmq
from PySide6.QtCore import QObject, Signal

from app.load_generator import LoadConfig, LoadGenerator, drive
from ipc import protocol as P
from ipc.client import ERR_ENGINE_GONE, EngineConnection
from ipc.kv_events import KVEventBatch
from ui.kv.prefix_tree_layout import TreeTracker
from ui.telemetry import GUI_ORIGIN, Frame

log = logging.getLogger(__name__)

TREE_REPLAY_ID = "gui-tree-replay"  # the worker's own control requests (not the panel's)
LOST_AFTER_FRAMES = 40  # ~2 s of telemetry at 20 Hz; a finished request's Finish comes first


class EngineLink(QObject):
    connected = Signal(object)  # ipc.protocol.Welcome
    connect_failed = Signal(str)
    replies = Signal(list)  # Delta / Finish / Error of the GUI's chats, Tokenized of its counts
    frames = Signal(list)  # list[Frame], every telemetry snapshot since the last batch
    control_reply = Signal(object)  # ControlAck, or Error carrying a control_id
    load_stats = Signal(dict)
    stalled = Signal(str)  # no word from the engine for `stall_timeout` seconds
    recovered = Signal()  # words again after a stall
    goodbye = Signal(str)  # the engine said it is shutting down
    prefix_tree = Signal(object, bool)  # TreeLayout, whether the tree has every event batch
    finished = Signal()  # the worker thread has closed its sockets and ended

    def __init__(self, endpoint: str, *, token: str | None = None, poll_ms: int = 20,
                 connect_timeout: float = 60.0, stall_timeout: float = 10.0,
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.endpoint = endpoint
        self.token = token
        self.poll_ms = poll_ms
        self.connect_timeout = connect_timeout
        self.stall_timeout = stall_timeout
        self.welcome: P.Welcome | None = None
        self._cmds: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._thread: threading.Thread | None = None
        self._chat_ids: set[str] = set()  # GUI requests in flight, as the worker sees them
        self._token_ids: set[str] = set()  # tokenize requests not yet answered
        self._ids = 0
        # request id -> consecutive telemetry frames without it (see _find_lost)
        self._absent: dict[str, int] = {}
        self.tree = TreeTracker()  # `tree.wanted` is set by the GUI while the panel shows

    # --- GUI-thread API (queue only) -------------------------------------------------------
    def start(self) -> None:
        assert self._thread is None
        self._thread = threading.Thread(target=self._run, name="kvscope-engine-link", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 3.0) -> None:
        if self._thread is None:
            return
        self._send(("close",))
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("engine link worker did not stop within %.1f s", timeout)
        else:
            for fd in (self._wake_r, self._wake_w):
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._thread = None

    def generate(self, request_id: str, messages: list[dict], sampling: dict) -> None:
        self._send(("generate", request_id, messages, sampling))

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def tokenize(self, request_id: str, text: str) -> bool:
        """Ask the engine for `text`'s tokens (no BOS: a fragment of a message); the `Tokenized`
        (or an Error) comes back through `replies` under `request_id`. True: an answer will come
        (the demo link's returns False)."""
        self._send(("tokenize", request_id, text))
        return True

    def control(self, op: str, **fields: Any) -> str:
        self._ids += 1
        control_id = f"gui-{self._ids}"
        self._send(("control", op, control_id, fields))
        return control_id

    def start_load(self, config: LoadConfig) -> None:
        self._send(("load_start", config))

    def stop_load(self) -> None:
        self._send(("load_stop",))

    def _send(self, cmd: tuple) -> None:
        self._cmds.put(cmd)
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    # --- worker thread ------------------------------------------------------------------------
    def _run(self) -> None:
        conn: EngineConnection | None = None
        try:
            conn = EngineConnection(self.endpoint, token=self.token, client_name=GUI_ORIGIN)
            if not self._handshake(conn):
                return
            self._loop(conn)
        except Exception as exc:  # the worker must never die silently
            log.exception("engine link worker failed")
            self.stalled.emit(f"engine link failed: {exc}")
        finally:
            if conn is not None:
                conn.close(goodbye=True)
            self.finished.emit()

    def _handshake(self, conn: EngineConnection) -> bool:
        conn.send_hello()
        deadline = time.monotonic() + self.connect_timeout
        while time.monotonic() < deadline:
            if self._closing_requested():
                return False
            for msg in conn.poll(100):
                if isinstance(msg, P.Welcome):
                    self.welcome = msg
                    conn.subscribe(msg.pub_endpoint)
                    self.connected.emit(msg)
                    return True
                if isinstance(msg, P.Error):
                    self.connect_failed.emit(f"[{msg.code}] {msg.message}")
                    return False
        self.connect_failed.emit(f"no answer from {self.endpoint} within "
                                 f"{self.connect_timeout:.0f} s")
        return False

    def _closing_requested(self) -> bool:
        # peek for a close command without losing the others
        keep, close = [], False
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "close":
                close = True
            keep.append(cmd)
        for cmd in keep:
            self._cmds.put(cmd)
        return close

    def _loop(self, conn: EngineConnection) -> None:
        gen = LoadGenerator()
        poller = zmq.Poller()
        for s in conn.sockets():
            poller.register(s, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        stalled = False
        last_stats = 0.0
        while True:
            poller.poll(self.poll_ms)
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except (BlockingIOError, OSError):
                pass
            if not self._do_commands(conn, gen):
                return
            msgs = conn.poll(0)
            self._dispatch(msgs, gen)
            self._track_tree(conn, msgs)
            msgs += self._find_lost(msgs, gen)
            if gen.running or gen.in_flight:
                drive(conn, gen, msgs)
                now = time.monotonic()
                if now - last_stats > 0.25:
                    last_stats = now
                    self.load_stats.emit(gen.stats.as_dict() | {"running": gen.running})
            silent = time.monotonic() - conn.last_engine_message
            if not stalled and silent > self.stall_timeout:
                stalled = True
                self.stalled.emit(f"no message from the engine for {silent:.0f} s")
            elif stalled and silent < self.stall_timeout:
                stalled = False
                self.recovered.emit()

    def _do_commands(self, conn: EngineConnection, gen: LoadGenerator) -> bool:
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return True
            kind = cmd[0]
            try:
                if kind == "close":
                    for rid in gen.stop():
                        conn.submit_abort(rid)
                    return False
                if kind == "generate":
                    _, rid, messages, sampling = cmd
                    self._chat_ids.add(rid)
                    conn.submit_generate(rid, messages=messages, sampling=sampling)
                elif kind == "abort":
                    conn.submit_abort(cmd[1])
                elif kind == "tokenize":
                    _, rid, text = cmd
                    self._token_ids.add(rid)
                    conn.send(P.Tokenize(request_id=rid, prompt=text, add_special_tokens=False))
                elif kind == "control":
                    _, op, control_id, fields = cmd
                    conn.submit_control(op, control_id, **fields)
                elif kind == "load_start":
                    gen.start(cmd[1])
                    for req in gen.next_requests():
                        conn.submit_generate(req.request_id, messages=req.messages,
                                             sampling=req.sampling)
                elif kind == "load_stop":
                    for rid in gen.stop():
                        conn.submit_abort(rid)
                    self.load_stats.emit(gen.stats.as_dict() | {"running": False})
            except (ValueError, zmq.ZMQError, TypeError) as exc:
                # a bad request must come back as an error, not kill the worker
                rid = cmd[1] if kind in ("generate", "abort", "tokenize") else None
                cid = cmd[2] if kind == "control" else None
                err = P.Error(code=P.ERR_INVALID_MESSAGE, message=str(exc), request_id=rid,
                              control_id=cid)
                if kind in ("generate", "tokenize"):
                    self._chat_ids.discard(rid)
                    self._token_ids.discard(rid)
                    self.replies.emit([err])
                elif kind == "control":
                    self.control_reply.emit(err)

    def _find_lost(self, msgs: list[Any], gen: LoadGenerator) -> list[Any]:
        """Requests the engine forgot without a Finish (it may drop a client it thought silent):
        absent from LOST_AFTER_FRAMES consecutive snapshots. Returns synthetic Errors for them
        (already delivered for chat requests; for the load generator, fed to `drive`)."""
        frames = [m for m in msgs if isinstance(m, P.Telemetry)]
        if not frames:
            return []
        tracked = self._chat_ids | gen.in_flight
        for rid in list(self._absent):
            if rid not in tracked:
                del self._absent[rid]
        lost: list[Any] = []
        for f in frames:
            present = {r.request_id for r in f.requests}
            for rid in tracked:
                n = 0 if rid in present else self._absent.get(rid, 0) + 1
                self._absent[rid] = n
                if n == LOST_AFTER_FRAMES:
                    log.warning("request %s vanished from the engine without a finish", rid)
                    lost.append(P.Error(code=ERR_ENGINE_GONE, request_id=rid,
                                        message="the engine dropped this request"))
        chat = [e for e in lost if e.request_id in self._chat_ids]
        for e in chat:
            self._chat_ids.discard(e.request_id)
        if chat:
            self.replies.emit(chat)
        return [e for e in lost if gen.owns(e.request_id)]

    def _track_tree(self, conn: EngineConnection, msgs: list[Any]) -> None:
        now = time.monotonic()
        for msg in msgs:
            if isinstance(msg, KVEventBatch):
                self.tree.on_batch(msg)
            elif isinstance(msg, P.Telemetry) and self.tree.needs_replay(msg.kv_events_seq, now):
                conn.submit_control("replay_kv_events", control_id=TREE_REPLAY_ID)
        layout = self.tree.maybe_layout(now)
        if layout is not None:
            self.prefix_tree.emit(layout, not self.tree.tree.stale)

    def _dispatch(self, msgs: list[Any], gen: LoadGenerator) -> None:
        replies: list[Any] = []
        frames: list[Frame] = []
        for msg in msgs:
            if isinstance(msg, P.Telemetry):
                try:
                    frames.append(Frame.from_wire(msg))
                except (ValueError, TypeError) as exc:
                    log.warning("bad telemetry snapshot: %s", exc)
            elif isinstance(msg, P.Delta | P.Finish):
                if msg.request_id in self._chat_ids:
                    replies.append(msg)
                    if isinstance(msg, P.Finish):
                        self._chat_ids.discard(msg.request_id)
            elif isinstance(msg, P.Tokenized):
                if msg.request_id in self._token_ids:
                    self._token_ids.discard(msg.request_id)
                    replies.append(msg)
            elif isinstance(msg, P.ControlAck):
                if msg.control_id != TREE_REPLAY_ID:
                    self.control_reply.emit(msg)
            elif isinstance(msg, P.Error):
                if msg.control_id == TREE_REPLAY_ID:
                    log.info("no KV event replay from this engine: %s", msg.message)
                elif msg.control_id:
                    self.control_reply.emit(msg)
                elif msg.request_id in self._token_ids:
                    self._token_ids.discard(msg.request_id)
                    replies.append(msg)
                elif msg.request_id in self._chat_ids:
                    if msg.code != P.ERR_UNKNOWN_REQUEST:
                        self._chat_ids.discard(msg.request_id)
                    replies.append(msg)
                elif msg.request_id is None:
                    log.warning("engine error: [%s] %s", msg.code, msg.message)
            elif isinstance(msg, P.Goodbye):
                self.goodbye.emit(msg.reason or "engine shut down")
        if replies:
            self.replies.emit(replies)
        if frames:
            self.frames.emit(frames)
