"""KV cache events (engine_proc/kv_events.py -> engine_proc/wire.py -> ipc/kv_events.py): the
prefix tree a subscriber rebuilds from the published events equals, after every engine step, the
tree read straight from the block pool (each cached block's hash and its parent's hash), through
evictions, flushes, caching toggles, lost batches and replays."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_proc import SamplingParams
from engine_proc.kv_events import KVEventLog
from engine_proc.wire import kv_event_batch
from ipc import kv_events as K
from ipc import protocol as P
from tests.engine_fixtures import tiny_engine

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
BLOCK = 4


def pool_tree(engine) -> dict[bytes, tuple[bytes | None, int, tuple[int, ...]]]:
    """The ground truth: every indexed block of the pool, by hash."""
    pool = engine.kv.pool
    out = {}
    for h, block_id in pool.hash_to_block.items():
        b = pool.blocks[block_id]
        assert b.block_hash == h
        out[h] = (b.parent_hash, block_id, b.token_ids)
    return out


def tree_of(tree: K.PrefixTree) -> dict[bytes, tuple[bytes | None, int, tuple[int, ...]]]:
    return {h: (n.parent_hash, n.block_id, tuple(n.token_ids)) for h, n in tree.nodes.items()}


class Subscriber:
    """What the window does: decode each published batch, apply it, ask for a replay on a gap."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.tree = K.PrefixTree()
        self.seq = 0
        self.replays = 0

    def tick(self, lose: bool = False) -> None:
        """One telemetry tick: the KV event batch (unless the PUB socket drops it), then the
        snapshot, whose kv_events_seq tells the subscriber whether it missed a batch."""
        events, _ = self.engine.drain_kv_events()
        if events:
            self.seq += 1
            if not lose:
                wire = P.encode(kv_event_batch(events, self.seq, 0.0, BLOCK))
                batch = P.decode_pub(wire)
                assert isinstance(batch, K.KVEventBatch)
                self.tree.apply(batch)
        if not self.tree.in_sync(self.seq):
            self.engine.replay_kv_events()  # the window's control op replay_kv_events
            self.replays += 1
            self.tick()


def test_prefill_stores_a_chain_and_eviction_removes_it():
    engine = tiny_engine(block_size=BLOCK, num_kv_blocks=8)
    engine.enable_kv_events()
    prompt = list(range(10, 23))  # 13 tokens: 3 full blocks
    engine.add_request("a", prompt, GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    events, overflowed = engine.drain_kv_events()
    assert not overflowed
    batch = kv_event_batch(events, 1, 0.0, BLOCK)
    stored = [e for e in batch.events if isinstance(e, K.BlockStored)]
    # the prompt's three blocks (and the generated tokens' block) as one chain from the root
    assert stored[0].parent_block_hash is None
    assert stored[0].token_ids[:12] == prompt[:12]
    assert sum(len(e.block_hashes) for e in stored) == len(pool_tree(engine))
    engine.reset_prefix_cache()
    events, _ = engine.drain_kv_events()
    batch = kv_event_batch(events, 2, 0.0, BLOCK)
    assert [type(e) for e in batch.events] == [K.BlockRemoved]
    assert len(batch.events[0].block_hashes) == sum(len(e.block_hashes) for e in stored)


def test_an_undrained_log_overflows_into_a_replay():
    log = KVEventLog(max_events=3)
    engine = tiny_engine(block_size=BLOCK, num_kv_blocks=32)
    engine.enable_kv_events()
    engine.kv.pool.events = log
    for i in range(3):
        engine.add_request(f"r{i}", [50 + i] * 12, GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    events, overflowed = engine.drain_kv_events()
    assert overflowed and type(events[0]).__name__ == "AllBlocksCleared"
    tree = K.PrefixTree()
    tree.apply(kv_event_batch(events, 1, 0.0, BLOCK))
    assert tree_of(tree) == pool_tree(engine)


def _ops(seed: int) -> list[tuple]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(5, 60) for _ in range(12)] for _ in range(3)]
    ops: list[tuple] = []
    for _ in range(rng.randrange(6, 14)):
        r = rng.random()
        if r < 0.1:
            ops.append(("reset",))
        elif r < 0.2:
            ops.append(("caching", rng.random() < 0.5))
        else:
            prompts = [
                prefixes[rng.randrange(3)][: rng.randrange(4, 13)]
                + [rng.randrange(5, 60) for _ in range(rng.randrange(0, 9))]
                for _ in range(rng.randrange(1, 4))
            ]
            ops.append(("run", prompts))
    return ops


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    seed=st.integers(0, 2**32 - 1),
    num_blocks=st.integers(6, 16),
    loss=st.sampled_from((0.0, 0.2)),
    events_on_late=st.booleans(),
)
def test_tree_from_events_equals_the_pool_after_every_step(seed, num_blocks, loss, events_on_late):
    engine = tiny_engine(block_size=BLOCK, num_kv_blocks=num_blocks)
    rng = random.Random(seed)
    sub = Subscriber(engine)
    if not events_on_late:
        engine.enable_kv_events()
    n = 0
    for op in _ops(seed):
        if op[0] == "run":
            for p in op[1]:
                engine.add_request(f"q{n}", p, GREEDY)
                n += 1
            while engine.has_unfinished_requests():
                engine.step()
                if engine.kv.pool.events is None:  # a subscriber attached mid-run
                    engine.enable_kv_events()
                sub.tick(lose=rng.random() < loss)
                assert tree_of(sub.tree) == pool_tree(engine)
        elif op[0] == "reset":
            engine.reset_prefix_cache()
        else:
            engine.set_prefix_caching(op[1])
        if engine.kv.pool.events is None:
            engine.enable_kv_events()
        sub.tick()
        assert tree_of(sub.tree) == pool_tree(engine)
