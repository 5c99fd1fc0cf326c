"""One publisher's batches, in order and whole, from what its two sockets deliver: the live PUB
stream and the answers to replay requests. No sockets here (the subscriber's worker does the
I/O and tells this what arrived); no Qt.

vLLM's and SGLang's publishers number their batches from 0 and keep the last `buffer_steps`
(10,000 by default) for replay; there is no snapshot, so a subscriber that joins late asks for a
replay from 0 and gets whatever the buffer still holds. The rules:
- on start (with a replay endpoint): ask for a replay from 0; live batches wait in a stash;
- a skipped sequence number: ask for a replay from the first missing one, stash what follows;
- the replay's end marker (or its timeout): apply the stash in order; a gap that a replay did
  not fill is counted as lost, never asked for twice;
- a live sequence number below the last applied one, or a new SGLang epoch in the topic: the
  publisher restarted (numbering starts again at 0): emit `Reset` (clear this source's blocks)
  and start over;
- a payload that does not decode: counted as garbage and skipped (its number still counts, so
  it does not look like a gap);
- no live batch yet since connecting (`catch_up`, asked by the caller now and then): ZeroMQ's
  SUB socket may have joined after the batches the first replay missed were published, and a
  gap at the tail shows only with the next batch, which a quiet publisher may never send: ask
  for what follows the last applied batch.
Without a replay endpoint a gap is only counted: the tree may then hold blocks the lost
batches removed, or miss blocks they stored.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ipc.vllm_events.decode import DecodeError, decode_payload
from ipc.vllm_events.events import Batch

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class Reset:
    """Forget what this source held: its publisher restarted."""

    why: str


Output = Batch | Reset


@dataclass(slots=True)
class SeqStats:
    batches: int = 0  # applied
    blocks: int = 0  # block events (stored + removed) in them
    garbage: int = 0  # frames or payloads that did not decode
    replays: int = 0  # replay requests sent
    replay_timeouts: int = 0
    lost: int = 0  # batches neither the live stream nor a replay delivered
    restarts: int = 0
    stash_overflow: int = 0  # live batches dropped while a replay was under way
    first_seq: int | None = None  # the first batch applied since (re)start: >0 = tree partial
    last_seq: int | None = None


class Sequencer:
    def __init__(self, replay: bool, stash_limit: int = 20_000) -> None:
        self.replay = replay  # whether the publisher has a replay endpoint
        self.stash_limit = stash_limit
        self.stats = SeqStats()
        self.out: list[Output] = []  # for the caller to take
        self.want_replay: int | None = None  # a request for the caller to send
        self.replaying = False
        self._last: int | None = None
        self._epoch: bytes | None = None
        self._stash: dict[int, bytes] = {}
        self._asked: int | None = None  # start of the last replay asked for
        self.live_seen = False  # a live batch arrived: the SUB socket has joined

    def start(self) -> None:
        if self.replay:
            self._ask(0)

    # ------------------------------------------------------------------ what arrived

    def catch_up(self) -> bool:
        """Ask for the batches after the last applied one, unless a live batch has arrived (or
        a replay is under way, or there is no replay endpoint); returns whether it asked. Not a
        gap's request: a later gap at the same place is still asked for."""
        if not self.replay or self.replaying or self.live_seen:
            return False
        self.want_replay = 0 if self._last is None else self._last + 1
        self.replaying = True
        self.stats.replays += 1
        return True

    def on_live(self, seq: int, payload: bytes, epoch: bytes | None = None) -> None:
        self.live_seen = True
        if epoch is not None:
            old, self._epoch = self._epoch, epoch
            if old is not None and epoch != old:
                self._restart(f"a new publisher epoch {epoch[:16]!r}")
                self._after_restart(seq, payload)
                return
        if self.replaying:
            self._put(seq, payload)
        elif self._last is None or seq == self._last + 1:
            self._accept(seq, payload)
        elif seq == self._last:
            pass  # a duplicate
        elif seq < self._last:
            self._restart(f"its sequence went back from {self._last} to {seq}")
            self._after_restart(seq, payload)
        else:
            self._gap(seq, payload)

    def on_replay(self, seq: int, payload: bytes) -> None:
        if not self.replaying:
            return  # a late answer to a replay given up on
        if self._last is None:
            self._accept(seq, payload)
        elif seq == self._last + 1:
            self._accept(seq, payload)
        elif seq > self._last + 1:  # the publisher's buffer no longer reaches back
            self.stats.lost += seq - self._last - 1
            self._accept(seq, payload)

    def on_replay_end(self) -> None:
        if self.replaying:
            self.replaying = False
            self._drain()

    def on_replay_timeout(self) -> None:
        if self.replaying:
            log.warning("replay from %s got no end marker in time", self._asked)
            self.stats.replay_timeouts += 1
            self.replaying = False
            self._drain()

    def garbage(self) -> None:
        """A frame the caller could not even parse (frames, topic, sequence)."""
        self.stats.garbage += 1

    # ------------------------------------------------------------------ rules

    def _gap(self, seq: int, payload: bytes) -> None:
        assert self._last is not None
        start = self._last + 1
        if self.replay and self._asked != start:
            self._ask(start)
            self._put(seq, payload)
            return
        self.stats.lost += seq - start  # no replay endpoint, or it could not fill this gap
        self._accept(seq, payload)

    def _restart(self, why: str) -> None:
        log.info("KV event publisher restarted: %s", why)
        self.stats.restarts += 1
        self.out.append(Reset(why))
        self._last, self._asked, self.stats.first_seq = None, None, None
        self._stash.clear()
        self.replaying = False

    def _after_restart(self, seq: int, payload: bytes) -> None:
        if self.replay and seq > 0:  # joined late: the first batches may still be buffered
            self._ask(0)
            self._put(seq, payload)
        else:
            self._accept(seq, payload)

    def _ask(self, start: int) -> None:
        self.want_replay = start
        self._asked = start
        self.replaying = True
        self.stats.replays += 1

    def _put(self, seq: int, payload: bytes) -> None:
        if len(self._stash) >= self.stash_limit:
            self.stats.stash_overflow += 1  # comes back as a gap after the replay
            return
        self._stash[seq] = payload

    def _drain(self) -> None:
        stash, self._stash = self._stash, {}
        for seq in sorted(stash):
            if self._last is not None and seq <= self._last:
                continue  # the replay brought it already
            if self.replaying:  # a gap asked for another replay: keep the rest waiting
                self._put(seq, stash[seq])
            else:
                self.on_live(seq, stash[seq])

    def _accept(self, seq: int, payload: bytes) -> None:
        self._last = self.stats.last_seq = seq
        if self.stats.first_seq is None:
            self.stats.first_seq = seq
        try:
            batch = decode_payload(payload, seq)
        except DecodeError as exc:
            log.warning("KV event batch %d skipped: %s", seq, exc)
            self.stats.garbage += 1
            return
        self.stats.batches += 1
        self.stats.blocks += sum(len(getattr(e, "block_hashes", ())) for e in batch.events)
        self.out.append(batch)
