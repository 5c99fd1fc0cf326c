"""ui/remote/kv_events_link.py over real sockets against the fake vLLM and SGLang publishers
(tests/ui/remote/fake_kv_publishers.py): joining late (a replay from 0), dropped messages (a
replay from the gap), garbage frames (counted, skipped), a restarted publisher (its blocks
cleared), a short replay buffer (a partial tree, said so), no replay endpoint, two publishers
at once, a GUI that falls behind (bounded). The tree the taken batches build equals the
fixture's own recount every time."""

from __future__ import annotations

import time

import pytest

from app.remote.kv_events_source import KvEventsSource
from ipc.vllm_events.events import Batch, Removed, Stored
from ipc.vllm_events.fleet_tree import FleetTree
from ipc.vllm_events.sequencer import Reset
from tests.ui.remote.fake_kv_publishers import (
    LAYOUTS,
    MEDIA,
    FakeCache,
    FakePublisher,
    expected_fleet,
)
from ui.remote.kv_events_link import KvEventsLink, split_batch


def source_of(pub: FakePublisher, replay: bool = True) -> KvEventsSource:
    return KvEventsSource(pub.endpoint, pub.replay_endpoint if replay else None, "kv@")


def nodes(tree: FleetTree) -> dict:
    return {h: (n.parent_hash, n.token_ids, n.media, n.sources) for h, n in tree.nodes.items()}


def drain_until(link: KvEventsLink, tree: FleetTree, done, timeout: float = 20.0) -> bool:
    """Apply what the link delivers until `done()` (the timeout only guards against a hang)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for name, item in link.take(256):
            if isinstance(item, Reset):
                tree.clear(name)
            else:
                tree.apply(name, item)
        if done():
            return True
        time.sleep(0.01)
    return False


def follow(link: KvEventsLink, tree: FleetTree, want, timeout: float = 20.0) -> bool:
    """Apply what the link delivers until the tree equals `want()` (re-read each time)."""
    return drain_until(link, tree, lambda: not link.pending and nodes(tree) == want(), timeout)


def run(pub: FakePublisher, cache: FakeCache, steps: int, **drops) -> None:
    for i in range(steps):
        pub.publish(cache.step(), drop=i in drops.get("drop", ()))


@pytest.fixture
def links():
    made: list[KvEventsLink] = []

    def make(*sources: KvEventsSource, **kw) -> KvEventsLink:
        link = KvEventsLink(list(sources), replay_timeout=2.0, **kw)
        made.append(link)
        link.start()
        return link

    yield make
    for link in made:
        link.stop()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_joining_late_replays_from_zero_then_follows_live(links, layout):
    with FakePublisher(layout) as pub:
        cache = FakeCache(seed=1, hash_kind="bytes" if layout == "sglang" else "int",
                          media=MEDIA[layout])  # fmt: skip
        run(pub, cache, 60)  # before anyone listens
        link = links(source_of(pub))
        tree = FleetTree()
        want = lambda: expected_fleet({pub.endpoint: pub.expected()})  # noqa: E731
        assert follow(link, tree, want), link.stats()
        run(pub, cache, 60)
        assert follow(link, tree, want)
        st = link.stats()[pub.endpoint]
        assert st.first_seq == 0 and st.lost == 0 and st.garbage == 0 and st.batches == 120


def test_dropped_messages_are_replayed_and_garbage_is_skipped(links):
    with FakePublisher("vllm-map") as pub:
        cache = FakeCache(seed=2)
        link = links(source_of(pub))
        tree = FleetTree()
        want = lambda: expected_fleet({pub.endpoint: pub.expected()})  # noqa: E731
        assert follow(link, tree, want)
        run(pub, cache, 40, drop={5, 6, 30, 39})
        pub.publish(cache.step())  # a drop shows as a gap only when something follows it
        assert follow(link, tree, want), link.stats()
        for kind in ("frames", "seq", "payload", "shape"):
            pub.send_garbage(kind)
        run(pub, cache, 20, drop={3})
        pub.publish(cache.step())
        assert follow(link, tree, want), link.stats()
        st = link.stats()[pub.endpoint]
        assert st.garbage == 4 and st.lost == 0 and st.replays >= 2 and st.batches == 62


def test_a_restarted_publisher_clears_what_it_held(links):
    with FakePublisher("sglang") as pub:
        cache = FakeCache(seed=3, media=MEDIA["sglang"])
        link = links(source_of(pub))
        tree = FleetTree()
        want = lambda: expected_fleet({pub.endpoint: pub.expected()})  # noqa: E731
        run(pub, cache, 40)
        assert follow(link, tree, want)
        pub.restart()
        cache = FakeCache(seed=4, media=MEDIA["sglang"])
        run(pub, cache, 30)
        assert follow(link, tree, want)
        assert link.stats()[pub.endpoint].restarts == 1


def test_a_short_replay_buffer_gives_a_partial_tree_and_says_so(links):
    with FakePublisher("vllm-array", buffer_steps=10) as pub:
        cache = FakeCache(seed=5)
        for _ in range(30):  # stores only: the last 10 batches' blocks are what a replay has
            pub.publish([cache._store(cache.prompt(), "GPU")])
        link = links(source_of(pub))
        tree = FleetTree()
        end = time.monotonic() + 20
        while link.stats()[pub.endpoint].first_seq is None and time.monotonic() < end:
            time.sleep(0.01)
        assert drain_until(link, tree, lambda: link.stats()[pub.endpoint].batches >= 10
                           and not link.pending)  # fmt: skip
        st = link.stats()[pub.endpoint]
        assert st.first_seq == 20 and st.batches == 10 and tree.nodes


def test_without_a_replay_endpoint_gaps_are_counted(links):
    with FakePublisher("vllm-map", replay=False) as pub:
        link = links(source_of(pub, replay=False))
        end = time.monotonic() + 20
        while not link.stats()[pub.endpoint].batches and time.monotonic() < end:
            pub.publish([])  # until the subscription is live (ZeroMQ's slow joiner)
            time.sleep(0.02)
        cache, tree = FakeCache(seed=6), FleetTree()
        run(pub, cache, 30)
        assert follow(link, tree, lambda: expected_fleet({pub.endpoint: pub.expected()}))
        run(pub, cache, 5, drop={2})
        pub.publish([])
        assert drain_until(link, tree, lambda: link.stats()[pub.endpoint].lost >= 1)
        assert link.stats()[pub.endpoint].lost == 1


def test_two_publishers_one_per_data_parallel_rank(links):
    with FakePublisher("vllm-map", rank=0) as a, FakePublisher("vllm-map", rank=1) as b:
        ca, cb = FakeCache(seed=7), FakeCache(seed=8)
        run(a, ca, 30)
        run(b, cb, 30)
        link = links(source_of(a), source_of(b))
        tree = FleetTree()
        want = lambda: expected_fleet({a.endpoint: a.expected(),  # noqa: E731
                                       b.endpoint: b.expected()})
        assert follow(link, tree, want)
        assert any(len(n.sources) == 2 for n in tree.nodes.values())


def test_a_gui_that_falls_behind_keeps_the_queue_bounded(links):
    with FakePublisher("vllm-map") as pub:
        cache = FakeCache(seed=9)
        link = links(source_of(pub), max_pending=20, chunk_blocks=2)
        tree = FleetTree()
        want = lambda: expected_fleet({pub.endpoint: pub.expected()})  # noqa: E731
        run(pub, cache, 400)
        peak, end, full_since = 0, time.monotonic() + 20, None
        while time.monotonic() < end:  # until the queue has been full for a while
            time.sleep(0.01)
            peak = max(peak, link.pending)
            if peak >= 20:
                full_since = full_since or time.monotonic()
                if time.monotonic() - full_since > 0.3:
                    break
        assert 20 <= peak <= 20 + 256 * 8  # stops reading once full (a read burst may overshoot)
        assert follow(link, tree, want)


def test_split_batch_cuts_long_chains_into_continuing_ones():
    hashes = tuple(range(1, 8))
    stored = Stored(block_hashes=hashes, parent_block_hash=0,
                    token_ids=tuple(t for h in hashes for t in (h, h)), block_size=2)
    batch = Batch(seq=4, ts=1.0, events=[stored, Removed(block_hashes=(1, 2))], dp_rank=1)
    parts = split_batch(batch, 3)
    assert [len(p.events) for p in parts] == [1, 1, 2]  # 3 + 3 + (1 + 2) blocks
    assert all(p.seq == 4 and p.dp_rank == 1 for p in parts)
    chains = [e for p in parts for e in p.events if isinstance(e, Stored)]
    assert [c.parent_block_hash for c in chains] == [0, 3, 6]
    assert [c.token_ids for c in chains][1] == (4, 4, 5, 5, 6, 6)
    a, b = FleetTree(), FleetTree()
    a.apply("s", batch)
    for p in parts:
        b.apply("s", p)
    assert a.nodes == b.nodes
    assert split_batch(Batch(seq=1, ts=0.0, events=[]), 3)[0].events == []
