"""ipc/vllm_events/fleet_tree.py: reference counts (vLLM stores one hash twice), media, many
sources, clear, the routing score; and long random streams from the fake publishers' simulated
caches, in every layout, equal to the fixture's own recount."""

from __future__ import annotations

import pytest

from ipc.vllm_events.decode import decode_payload
from ipc.vllm_events.events import Batch, Cleared, Removed, Stored
from ipc.vllm_events.fleet_tree import FleetTree
from tests.ui.remote.fake_kv_publishers import (
    LAYOUTS,
    MEDIA,
    FakeCache,
    encode,
    expected_fleet,
    recount,
)


def stored(hashes, parent, tokens, medium="GPU", bs=2) -> Stored:
    return Stored(block_hashes=tuple(hashes), parent_block_hash=parent,
                  token_ids=tuple(tokens), block_size=bs, medium=medium)


def batch(*events) -> Batch:
    return Batch(seq=0, ts=0.0, events=list(events))


def test_a_hash_stored_twice_lives_until_its_second_removal():
    t = FleetTree()
    t.apply("a", batch(stored([1, 2], None, [5, 6, 7, 8])))
    t.apply("a", batch(stored([2], 1, [7, 8])))
    assert t.references("a", 2) == {"GPU": 2}
    t.apply("a", batch(Removed(block_hashes=(2,), medium="GPU")))
    assert 2 in t.nodes
    t.apply("a", batch(Removed(block_hashes=(2,), medium="GPU")))
    assert 2 not in t.nodes and t.edges() == {1: None}


def test_media_are_counted_apart_and_none_is_the_gpu():
    t = FleetTree()
    t.apply("a", batch(stored([1], None, [5, 6], medium=None), stored([1], None, [5, 6], "CPU")))
    assert t.nodes[1].media == {"GPU", "CPU"}
    t.apply("a", batch(Removed(block_hashes=(1,), medium=None)))
    assert t.nodes[1].media == {"CPU"}
    t.apply("a", batch(Removed(block_hashes=(1, 99), medium="DISK")))  # not held there: no-op
    assert t.nodes[1].media == {"CPU"}


def test_sources_hold_blocks_apart_and_clear_forgets_one():
    t = FleetTree()
    t.apply("a", batch(stored([1, 2], None, [5, 6, 7, 8])))
    t.apply("b", batch(stored([1, 3], None, [5, 6, 0, 0])))
    assert t.sources_holding(1) == {"a", "b"} and t.sources_holding(2) == {"a"}
    assert t.sources() == {"a": 2, "b": 2}
    v = t.version
    assert t.clear("a") and t.version > v
    assert t.sources_holding(1) == {"b"} and 2 not in t.nodes
    assert not t.clear("a")
    t.apply("b", batch(Cleared()))
    assert t.nodes == {}


def test_a_child_whose_parent_is_gone_becomes_a_root():
    t = FleetTree()
    t.apply("a", batch(stored([1, 2, 3], None, [1, 1, 2, 2, 3, 3])))
    t.apply("a", batch(Removed(block_hashes=(1,), medium="GPU")))
    assert t.children() == {None: [2], 2: [3]}
    assert t.edges() == {2: 1, 3: 2}  # the recorded parent stays


def test_longest_prefix_walks_the_prompt_through_one_sources_blocks():
    t = FleetTree()
    t.apply("a", batch(stored([1, 2, 3], None, [1, 1, 2, 2, 3, 3])))
    t.apply("b", batch(stored([1, 2], None, [1, 1, 2, 2]),
                       stored([7], 2, [4, 4], medium="CPU")))
    t.apply("b", batch(stored([8], 2, [4, 4])))  # same step, another hash (extra keys)
    prompt = [1, 1, 2, 2, 3, 3, 9]
    assert t.longest_prefix("a", prompt, 2) == 3
    assert t.longest_prefix("b", prompt, 2) == 2
    assert t.longest_prefix("b", [1, 1, 2, 2, 4, 4], 2) == 3
    assert t.longest_prefix("b", [1, 1, 2, 2, 4, 4], 2, media=["CPU"]) == 0
    assert t.longest_prefix("c", prompt, 2) == 0
    assert t.longest_prefix("a", [9, 9, 1, 1], 2) == 0  # a prefix starts at a root
    t.apply("a", batch(Removed(block_hashes=(2,), medium="GPU")))
    assert t.longest_prefix("a", prompt, 2) == 1


def test_snapshot_is_a_copy_the_next_batch_does_not_change():
    t = FleetTree()
    t.apply("a", batch(stored([1], None, [1, 1])))
    snap = t.snapshot()
    t.apply("a", batch(stored([2], 1, [2, 2])))
    assert list(snap.nodes) == [1] and snap.children() == {None: [1]}


@pytest.mark.parametrize("hash_kind", ["int", "bytes"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_random_streams_equal_the_recount(layout, hash_kind):
    caches = {f"pub{i}": FakeCache(seed=i, hash_kind=hash_kind, media=MEDIA[layout])
              for i in range(2)}  # fmt: skip
    log: dict[str, list] = {s: [] for s in caches}
    t = FleetTree()
    for step in range(1500):
        for source, cache in caches.items():
            events = cache.step()
            log[source] += events
            t.apply(source, decode_payload(encode(layout, events), step))
    want = expected_fleet({s: recount(evs) for s, evs in log.items()})
    got = {h: (n.parent_hash, n.token_ids, n.media, n.sources) for h, n in t.nodes.items()}
    assert got == want and len(want) > 20
    shared = [h for h, v in want.items() if len(v[3]) == 2]
    assert shared  # the same system prompts: both sources hold the same first blocks
