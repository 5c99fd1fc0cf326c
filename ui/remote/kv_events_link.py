"""The window's subscription to vLLM-format KV event publishers (vLLM's and SGLang's
`--kv-events-config`, KVScope's): one worker thread holds a SUB socket per publisher (and a
DEALER to its replay endpoint when there is one), puts what arrives through that publisher's
`Sequencer` (ipc/vllm_events/sequencer.py: replay from 0 on connect and after a skipped
sequence number, a restart clears the source, garbage is counted and skipped) and queues the
decoded batches, cut into chunks of at most `chunk_blocks` blocks, for the GUI thread, which
takes them on its timer (`take`), as much as its time budget allows.

Nothing here blocks the GUI thread and every queue is bounded: when the GUI falls behind (the
outbox holds `max_pending` chunks), the worker stops reading; the publisher's and the SUB
socket's high-water marks then drop messages, which the sequencer sees as a gap and fills by a
replay once the GUI has caught up. No Qt: signals are not needed where the reader polls.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time

import zmq

from app.remote.kv_events_source import KvEventsSource
from ipc.vllm_events.decode import (
    DecodeError,
    parse_live,
    parse_replay,
    replay_request,
    topic_epoch,
)
from ipc.vllm_events.events import Batch, Removed, Stored
from ipc.vllm_events.sequencer import Output, SeqStats, Sequencer

log = logging.getLogger(__name__)

Item = tuple[str, Output]  # (source name, a chunk of a batch or a Reset)
READ_BURST = 256  # messages read from one socket before looking at the others
# Until the first live batch: ask the replay endpoint for what followed after these many
# seconds, doubling up to the last (Sequencer.catch_up: a SUB socket that joined late)
CATCH_UP_S = (1.0, 30.0)


def split_batch(batch: Batch, max_blocks: int) -> list[Batch]:
    """`batch` as consecutive batches (same seq) of at most `max_blocks` block events each: the
    GUI applies one per step, so a 10,000-block replay does not hold it for a whole frame. A
    long BlockStored chain is cut into shorter chains, each continuing the one before."""
    out: list[Batch] = []
    cur, size = [], 0
    for event in batch.events:
        for part in _split_event(event, max_blocks):
            n = len(getattr(part, "block_hashes", ())) or 1
            if cur and size + n > max_blocks:
                out.append(Batch(batch.seq, batch.ts, cur, batch.dp_rank))
                cur, size = [], 0
            cur.append(part)
            size += n
    if cur or not out:
        out.append(Batch(batch.seq, batch.ts, cur, batch.dp_rank))
    return out


def _split_event(event, max_blocks: int) -> list:
    hashes = getattr(event, "block_hashes", ())
    if len(hashes) <= max_blocks:
        return [event]
    parts = []
    for start in range(0, len(hashes), max_blocks):
        chunk = hashes[start : start + max_blocks]
        if isinstance(event, Removed):
            parts.append(dataclasses.replace(event, block_hashes=chunk))
            continue
        assert isinstance(event, Stored)
        bs = event.block_size
        parent = event.parent_block_hash if start == 0 else hashes[start - 1]
        tokens = event.token_ids[start * bs : (start + len(chunk)) * bs]
        parts.append(dataclasses.replace(event, block_hashes=chunk, parent_block_hash=parent,
                                         token_ids=tokens))
    return parts


class _Subscription:
    """One publisher's sockets and sequencer (worker thread only)."""

    def __init__(self, ctx: zmq.Context, source: KvEventsSource, poller: zmq.Poller,
                 replay_timeout: float) -> None:  # fmt: skip
        self.source = source
        self.ctx, self.poller, self.replay_timeout = ctx, poller, replay_timeout
        self.seq = Sequencer(replay=source.replay is not None)
        self.topic = source.topic.encode()
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.RCVHWM, 100_000)  # vLLM's PUB high-water mark
        self.sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self.sub.connect(source.endpoint)
        poller.register(self.sub, zmq.POLLIN)
        self.dealer: zmq.Socket | None = None
        self._progress = 0.0  # when the replay last asked for or last answered
        self._catch_up_wait = CATCH_UP_S[0]
        self._catch_up_at: float | None = None
        if source.replay:
            self._open_dealer()
            self._catch_up_at = time.monotonic() + self._catch_up_wait

    def _open_dealer(self) -> None:
        assert self.source.replay is not None
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.connect(self.source.replay)
        self.poller.register(self.dealer, zmq.POLLIN)

    def read(self, ready: dict) -> None:
        if ready.get(self.sub):
            self._read_live()
        if self.dealer is not None and ready.get(self.dealer):
            self._read_replay()

    def _read_live(self) -> None:
        for _ in range(READ_BURST):
            try:
                frames = self.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                f = parse_live(frames, self.topic)
            except DecodeError as exc:
                log.warning("%s: garbage frame skipped: %s", self.source.name, exc)
                self.seq.garbage()
                continue
            self.seq.on_live(f.seq, f.payload, topic_epoch(f.topic))

    def _read_replay(self) -> None:
        assert self.dealer is not None
        for _ in range(READ_BURST):
            try:
                frames = self.dealer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._progress = time.monotonic()
            try:
                f = parse_replay(frames)
            except DecodeError as exc:
                log.warning("%s: garbage replay frame skipped: %s", self.source.name, exc)
                self.seq.garbage()
                continue
            if f is None:
                self.seq.on_replay_end()
            else:
                self.seq.on_replay(f.seq, f.payload)

    def service(self, now: float) -> None:
        """Send a replay request the sequencer wants; give up on a replay that went silent;
        until the first live batch, now and then ask for what may have been missed."""
        if self._catch_up_at is not None and now >= self._catch_up_at:
            if self.seq.live_seen:
                self._catch_up_at = None
            else:
                self.seq.catch_up()
                self._catch_up_wait = min(2 * self._catch_up_wait, CATCH_UP_S[1])
                self._catch_up_at = now + self._catch_up_wait
        start = self.seq.want_replay
        if start is not None and self.dealer is not None:
            self.seq.want_replay = None
            self.dealer.send_multipart(replay_request(start))
            self._progress = now
        if self.seq.replaying and now - self._progress > self.replay_timeout:
            self.seq.on_replay_timeout()
            # a fresh socket: a late answer must not end the next replay early
            self.close_dealer()
            self._open_dealer()

    def hold(self) -> None:
        """Not reading (the GUI is behind): a replay under way is not silent, only waiting."""
        self._progress = time.monotonic()

    def close_dealer(self) -> None:
        if self.dealer is not None:
            self.poller.unregister(self.dealer)
            self.dealer.close(0)
            self.dealer = None

    def close(self) -> None:
        self.close_dealer()
        self.poller.unregister(self.sub)
        self.sub.close(0)


class KvEventsLink:
    def __init__(self, sources: list[KvEventsSource], *, max_pending: int = 2_000,
                 chunk_blocks: int = 512, replay_timeout: float = 5.0) -> None:  # fmt: skip
        if not sources:
            raise ValueError("no KV event publisher to subscribe to")
        self.sources = list(sources)
        self.max_pending = max_pending
        self.chunk_blocks = chunk_blocks
        self.replay_timeout = replay_timeout
        self.errors: dict[str, str] = {}  # source -> why its sockets could not be set up
        self._outbox: collections.deque[Item] = collections.deque()
        self._stats: dict[str, SeqStats] = {s.name: SeqStats() for s in sources}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- GUI-thread API ---------------------------------------------------------------------
    def start(self) -> None:
        assert self._thread is None
        self._thread = threading.Thread(target=self._run, name="kvscope-kv-events", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("KV events worker did not stop within %.1f s", timeout)
            self._thread = None

    def take(self, max_items: int) -> list[Item]:
        """Up to `max_items` chunks, oldest first (deque pops are atomic: no lock needed)."""
        out: list[Item] = []
        box = self._outbox
        while box and len(out) < max_items:
            out.append(box.popleft())
        return out

    @property
    def pending(self) -> int:
        return len(self._outbox)

    def stats(self) -> dict[str, SeqStats]:
        """Per source, a copy of its counters (the worker updates them as it goes)."""
        return {name: dataclasses.replace(s) for name, s in self._stats.items()}

    # --- worker thread ----------------------------------------------------------------------
    def _run(self) -> None:
        ctx = zmq.Context()
        poller = zmq.Poller()
        subs: list[_Subscription] = []
        try:
            subs = self._open(ctx, poller)
            while not self._stop.is_set():
                self._step(subs, poller)
        except Exception:  # the worker must never die silently
            log.exception("KV events worker failed")
            self.errors.setdefault("", "the KV events worker failed; see the log")
        finally:
            for s in subs:
                s.close()
            ctx.term()

    def _open(self, ctx: zmq.Context, poller: zmq.Poller) -> list[_Subscription]:
        subs = []
        for source in self.sources:
            try:
                sub = _Subscription(ctx, source, poller, self.replay_timeout)
            except zmq.ZMQError as exc:
                log.error("cannot subscribe to %s: %s", source.name, exc)
                self.errors[source.name] = str(exc)
                continue
            self._stats[source.name] = sub.seq.stats
            sub.seq.start()
            subs.append(sub)
        return subs

    def _step(self, subs: list[_Subscription], poller: zmq.Poller) -> None:
        if len(self._outbox) >= self.max_pending:
            self._stop.wait(0.02)  # the GUI is behind: let the sockets' queues fill
            for s in subs:
                s.hold()
            return
        now = time.monotonic()
        for s in subs:
            s.service(now)
        ready = dict(poller.poll(50))
        for s in subs:
            s.read(ready)
            self._deliver(s)

    def _deliver(self, s: _Subscription) -> None:
        out, s.seq.out = s.seq.out, []
        name = s.source.name
        for item in out:
            if isinstance(item, Batch) and item.events:
                self._outbox.extend((name, b) for b in split_batch(item, self.chunk_blocks))
            elif not isinstance(item, Batch):
                self._outbox.append((name, item))
