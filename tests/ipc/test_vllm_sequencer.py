"""ipc/vllm_events/sequencer.py without sockets: replay from 0 on start, a skipped number asks
for a replay, the stash applied after it in order, duplicates dropped, a restart (numbers
back to 0, or a new SGLang epoch) resets the source, garbage counted and skipped, and without a
replay endpoint a gap is only counted."""

from __future__ import annotations

from ipc.vllm_events.events import Batch
from ipc.vllm_events.sequencer import Sequencer
from tests.ui.remote.fake_kv_publishers import encode


def payload(seq: int) -> bytes:
    return encode("vllm-map", [("store", [seq], None, [seq, seq], 2, "GPU")])


def seqs(s: Sequencer) -> list:
    out, s.out = s.out, []
    return [o.seq if isinstance(o, Batch) else "reset" for o in out]


def test_start_replays_from_zero_and_stashes_the_live_stream():
    s = Sequencer(replay=True)
    s.start()
    assert s.want_replay == 0 and s.replaying
    for n in (5, 6):
        s.on_live(n, payload(n))
    assert seqs(s) == []
    for n in range(6):  # the replay overlaps what came live
        s.on_replay(n, payload(n))
    s.on_replay_end()
    assert seqs(s) == [0, 1, 2, 3, 4, 5, 6]
    assert s.stats.first_seq == 0 and s.stats.lost == 0 and s.stats.batches == 7


def test_a_skipped_number_asks_for_the_missing_ones():
    s = Sequencer(replay=True)
    s.on_live(0, payload(0))
    s.on_live(1, payload(1))
    s.on_live(4, payload(4))
    assert s.want_replay == 2 and seqs(s) == [0, 1]
    s.on_live(5, payload(5))
    s.on_replay(2, payload(2))
    s.on_replay(3, payload(3))
    s.on_replay(4, payload(4))
    s.on_replay_end()
    assert seqs(s) == [2, 3, 4, 5] and s.stats.replays == 1 and s.stats.lost == 0


def test_a_gap_the_replay_cannot_fill_is_lost_once():
    s = Sequencer(replay=True)
    s.on_live(0, payload(0))
    s.on_live(3, payload(3))
    s.want_replay = None
    s.on_replay_end()  # the buffer had nothing from 1 on
    assert seqs(s) == [0, 3] and s.stats.lost == 2 and s.want_replay is None


def test_a_trimmed_buffer_makes_a_partial_start():
    s = Sequencer(replay=True)
    s.start()
    s.on_replay(100, payload(100))
    s.on_replay(101, payload(101))
    s.on_replay_end()
    assert seqs(s) == [100, 101] and s.stats.first_seq == 100


def test_a_replay_that_never_ends_times_out():
    s = Sequencer(replay=True)
    s.start()
    s.on_live(3, payload(3))
    s.on_replay_timeout()
    assert seqs(s) == [3] and s.stats.replay_timeouts == 1 and not s.replaying
    s.on_replay(0, payload(0))  # a late answer changes nothing
    assert seqs(s) == []


def test_numbers_going_back_are_a_restart():
    s = Sequencer(replay=False)
    for n in range(3):
        s.on_live(n, payload(n))
    s.on_live(2, payload(2))  # a duplicate
    s.on_live(0, payload(0))
    assert seqs(s) == [0, 1, 2, "reset", 0] and s.stats.restarts == 1


def test_a_restart_seen_late_replays_the_new_publishers_start():
    s = Sequencer(replay=True)
    s.on_live(0, payload(0))
    s.on_live(1, payload(1))
    s.on_live(2, payload(2), epoch=b"e1")
    assert seqs(s) == [0, 1, 2]
    s.on_live(3, payload(3), epoch=b"e2")  # a new epoch: SGLang restarted, joined late
    assert s.want_replay == 0 and seqs(s) == ["reset"]
    for n in range(3):
        s.on_replay(n, payload(n))
    s.on_replay_end()
    assert seqs(s) == [0, 1, 2, 3]


def test_garbage_is_counted_and_its_number_used():
    s = Sequencer(replay=True)
    s.on_live(0, payload(0))
    s.on_live(1, b"\xc1 garbage")
    s.on_live(2, payload(2))
    s.garbage()
    assert seqs(s) == [0, 2] and s.stats.garbage == 2 and s.want_replay is None


def test_without_a_replay_endpoint_a_gap_is_only_counted():
    s = Sequencer(replay=False)
    s.start()
    assert s.want_replay is None and not s.replaying
    s.on_live(10, payload(10))
    s.on_live(13, payload(13))
    assert seqs(s) == [10, 13] and s.stats.lost == 2 and s.stats.first_seq == 10


def test_the_stash_is_bounded():
    s = Sequencer(replay=True, stash_limit=3)
    s.start()
    for n in range(10):
        s.on_live(n, payload(n))
    assert s.stats.stash_overflow == 7
    s.on_replay_end()  # the replay brought nothing: what the stash kept is applied
    assert seqs(s) == [0, 1, 2]
    s.on_live(10, payload(10))  # what overflowed is a gap: asked for again
    assert s.want_replay == 3 and s.replaying


def test_a_late_joining_sub_socket_is_caught_up_by_replay_until_a_live_batch_arrives():
    """The first replay gave 0..2; batches 3..5 were published before the SUB socket joined and
    none follows: only a catch-up replay finds them. A later gap at the same place is still
    asked for, and once a live batch has arrived catch-up asks nothing."""
    s = Sequencer(replay=True)
    s.start()
    for n in range(3):
        s.on_replay(n, payload(n))
    s.on_replay_end()
    assert seqs(s) == [0, 1, 2]
    s.want_replay = None
    assert s.catch_up() and s.want_replay == 3 and s.replaying
    assert not s.catch_up()  # one at a time
    for n in range(3, 6):
        s.on_replay(n, payload(n))
    s.on_replay_end()
    assert seqs(s) == [3, 4, 5] and s.stats.lost == 0
    s.want_replay = None
    assert s.catch_up() and s.want_replay == 6
    s.on_replay_end()  # nothing new
    s.on_live(8, payload(8))  # the stream joined, two batches after the last applied
    assert s.want_replay == 6 and s.replaying  # the gap is asked for, though 6 was caught up
    for n in (6, 7):
        s.on_replay(n, payload(n))
    s.on_replay_end()
    assert seqs(s) == [6, 7, 8] and s.stats.lost == 0
    assert not s.catch_up()


def test_without_a_replay_endpoint_catch_up_asks_nothing():
    s = Sequencer(replay=False)
    assert not s.catch_up() and s.want_replay is None
