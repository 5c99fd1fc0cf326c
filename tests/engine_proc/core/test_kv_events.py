"""KV cache events (engine_proc/core/kv_events.py -> engine_proc/server/wire.py ->
ipc/kv_events.py): the prefix tree a subscriber rebuilds from the published events equals, after
every engine step, the tree read straight from the engine's state (each pool block's hash and parent
hash, and which of the host and disk tiers' indexes hold each hash), through evictions into the
tiers, loads back, flushes, caching toggles, corrupt disk entries, engine restarts over the same
disk tier, lost batches and replays; and a full replay rebuilds the same tree. Every parent hash and
token list is also checked independently: the block's hash recomputed from them must be the block's
hash."""

from __future__ import annotations

import functools
import hashlib
import random
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engine_proc import LLMEngine, SamplingParams
from engine_proc.core.kv_cache_manager import block_hash, root_hash
from engine_proc.core.kv_events import KVEventLog
from engine_proc.kv_store.disk import DISK_SUFFIX, HEADER
from engine_proc.server.wire import kv_event_batch
from ipc import kv_events as K
from ipc import protocol as P
from tests.engine_fixtures import tiny_engine

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
BLOCK = 4
Tree = dict[bytes, tuple[bytes | None, int, tuple[int, ...], frozenset[str]]]


def _check_link(engine: LLMEngine, h: bytes, parent: bytes | None, tokens: tuple[int, ...]) -> None:
    """Independent of the tree code: the hash chain itself vouches for a parent and tokens."""
    root = root_hash(engine.cache_identity, None)
    assert block_hash(parent or root, list(tokens)) == h, "parent or tokens do not give the hash"


def pool_tree(engine: LLMEngine) -> Tree:
    """The ground truth: every indexed block of the pool by hash, then every entry of the lower
    tiers' indexes, each with the media that hold it."""
    pool = engine.kv.pool
    out: dict[bytes, list] = {}
    for h, block_id in pool.hash_to_block.items():
        b = pool.blocks[block_id]
        assert b.block_hash == h
        _check_link(engine, h, b.parent_hash, b.token_ids)
        out[h] = [b.parent_hash, block_id, b.token_ids, {"pool"}]
    tiers = engine.kv.tiers
    for medium, tier in (("host", tiers and tiers.host), ("disk", tiers and tiers.disk)):
        for h in tier.index if tier else ():
            parent, tokens = tier.links[h]
            _check_link(engine, h, parent, tokens)
            out.setdefault(h, [parent, -1, tokens, set()])[3].add(medium)
    return {h: (p, b, t, frozenset(m)) for h, (p, b, t, m) in out.items()}


def tree_of(tree: K.PrefixTree) -> Tree:
    return {
        h: (n.parent_hash, n.block_id, tuple(n.token_ids), frozenset(n.media))
        for h, n in tree.nodes.items()
    }


def replayed(engine: LLMEngine) -> Tree:
    """The tree a fresh subscriber builds from one full replay, whose blocks come parents
    first."""
    batch = kv_event_batch(engine.kv_event_replay(), 1, 0.0, BLOCK)
    in_replay = {h for e in batch.events if isinstance(e, K.BlockStored) for h in e.block_hashes}
    seen: set[bytes] = set()
    for e in batch.events:
        if isinstance(e, K.BlockStored):
            p = e.parent_block_hash
            assert p is None or p in seen or p not in in_replay, "a child before its parent"
            seen.update(e.block_hashes)
    tree = K.PrefixTree()
    tree.apply(batch)
    return tree_of(tree)


class Subscriber:
    """What the window does: decode each published batch, apply it, ask for a replay on a gap."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tree = K.PrefixTree()
        self.seq = 0
        self.replays = 0

    def restart(self, engine: LLMEngine) -> None:
        """A new engine process: its batches are numbered from 1 again."""
        self.engine, self.seq = engine, 0

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
                for e in batch.events:  # pool block ids for pool blocks only
                    if isinstance(e, K.BlockStored):
                        pool = e.medium == "pool"
                        assert len(e.block_ids) == (len(e.block_hashes) if pool else 0)
                self.tree.apply(batch)
        if not self.tree.in_sync(self.seq):
            self.engine.replay_kv_events()  # the window's control op replay_kv_events
            self.replays += 1
            self.tick()

    def check(self) -> None:
        truth = pool_tree(self.engine)
        assert tree_of(self.tree) == truth
        assert replayed(self.engine) == truth


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


def _hn(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def _stored(names: str, parent: str | None, medium: str, first_id: int = -1) -> K.BlockStored:
    return K.BlockStored(
        block_hashes=[_hn(n) for n in names],
        parent_block_hash=None if parent is None else _hn(parent),
        token_ids=[ord(n) for n in names for _ in range(BLOCK)],
        block_size=BLOCK,
        block_ids=list(range(first_id, first_id + len(names))) if medium == "pool" else [],
        medium=medium,
    )


def test_a_node_lives_while_some_medium_holds_it():
    tree = K.PrefixTree()
    tree.apply(K.KVEventBatch(seq=1, time=0.0, events=[
        _stored("abc", None, "pool", first_id=0),  # a <- b <- c in pool blocks 0-2
        _stored("ab", None, "host"),
        _stored("b", "a", "disk"),
        K.BlockRemoved(block_hashes=[_hn("a"), _hn("b"), _hn("c")]),
    ]))  # fmt: skip
    media = {h: set(m) for h, m in tree.media().items()}
    assert media == {_hn("a"): {"host"}, _hn("b"): {"host", "disk"}}
    assert tree.edges() == {_hn("a"): None, _hn("b"): _hn("a")}
    assert all(n.block_id == -1 and n.tier_only for n in tree.nodes.values())
    tree.apply(K.KVEventBatch(seq=2, time=0.0, events=[
        _stored("b", "a", "pool", first_id=7),  # loaded back into pool block 7
        K.AllBlocksCleared(medium="host"),
    ]))  # fmt: skip
    assert {h: set(m) for h, m in tree.media().items()} == {_hn("b"): {"pool", "disk"}}
    assert tree.nodes[_hn("b")].block_id == 7 and tree.children() == {None: [_hn("b")]}


def test_only_a_clear_of_every_medium_after_the_last_loss_makes_the_tree_whole():
    tree = K.PrefixTree()
    clear = {m: K.AllBlocksCleared(medium=m) for m in ("pool", "host", "disk")}
    assert tree.apply(K.KVEventBatch(seq=1, time=0.0, events=[_stored("a", None, "host")]))
    assert not tree.apply(K.KVEventBatch(seq=3, time=0.0, events=[clear["pool"], clear["host"]]))
    assert not tree.in_sync(5)  # batch 4 and 5 lost too: the clears before them count no more
    assert not tree.apply(K.KVEventBatch(seq=6, time=0.0, events=[clear["disk"]]))
    batch = K.KVEventBatch(seq=7, time=0.0, events=[*clear.values(), _stored("b", None, "disk")])
    assert tree.apply(batch) and tree.in_sync(7) and list(tree.nodes) == [_hn("b")]


def test_an_undrained_log_overflows_into_a_replay():
    engine = tiny_engine(block_size=BLOCK, num_kv_blocks=6, kv_host_memory=3 * _block_bytes())
    engine.enable_kv_events(KVEventLog(max_events=3))
    for i in range(3):
        engine.add_request(f"r{i}", [50 + i] * 12, GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    events, overflowed = engine.drain_kv_events()
    assert overflowed and type(events[0]).__name__ == "AllBlocksCleared"
    tree = K.PrefixTree()
    tree.apply(kv_event_batch(events, 1, 0.0, BLOCK))
    truth = pool_tree(engine)
    assert tree_of(tree) == truth
    assert any("host" in m for *_, m in truth.values())  # the tiers' part was replayed too


@functools.cache
def _block_bytes() -> int:
    return tiny_engine(block_size=BLOCK, num_kv_blocks=1).block_bytes


def _tiered_engine(num_blocks: int, host_blocks: int, disk_dir: str | None, disk_blocks: int,
                   write_through: bool = False) -> LLMEngine:  # fmt: skip
    bb = _block_bytes()
    return tiny_engine(
        block_size=BLOCK,
        num_kv_blocks=num_blocks,
        kv_host_memory=host_blocks * bb,
        kv_disk_dir=disk_dir,
        kv_disk_bytes=disk_blocks * (HEADER.size + 4 * BLOCK + bb),
        kv_tier_policy="write_through" if write_through else "write_back",
    )


def _run(engine: LLMEngine, sub: Subscriber, prompts: list[list[int]], tag: str) -> None:
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}{i}", p, GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
        sub.tick()
        sub.check()


def test_evicted_blocks_live_on_in_the_tiers_and_come_back_after_a_restart(tmp_path):
    """Small and deterministic: prompts that overflow a 6-block pool write their prefixes down
    into a 2-block host tier and a disk tier; the tree keeps them, marked by tier, with their
    parents; a new engine over the same disk publishes the same disk part of the tree."""
    engine = _tiered_engine(6, 2, str(tmp_path), 40)
    engine.enable_kv_events()
    sub = Subscriber(engine)
    prompts = [[10 + k] * 4 + list(range(20 + k, 29 + k)) for k in range(4)]  # 3 full blocks
    for k, p in enumerate(prompts):
        _run(engine, sub, [p], f"a{k}")
    tree = tree_of(sub.tree)
    tier_only = [(parent, m) for parent, _, _, m in tree.values() if "pool" not in m]
    assert {m for _, m in tier_only} == {frozenset({"host", "disk"}), frozenset({"disk"})}
    assert any(parent is not None for parent, _ in tier_only)  # not all published as roots
    first = block_hash(root_hash(engine.cache_identity, None), prompts[0][:4])
    assert "pool" not in tree[first][3]
    _run(engine, sub, [prompts[0]], "b")  # loaded back into the pool
    assert "pool" in tree_of(sub.tree)[first][3]
    engine.flush_kv_tiers()
    sub.tick()
    sub.check()
    on_disk = {h: (p, t) for h, (p, _, t, m) in tree_of(sub.tree).items() if "disk" in m}
    again = _tiered_engine(6, 2, str(tmp_path), 40)
    again.enable_kv_events()
    sub.restart(again)
    sub.tick()
    sub.check()
    tree = tree_of(sub.tree)
    assert {h: (p, t) for h, (p, _, t, _) in tree.items()} == on_disk
    assert {m for *_, m in tree.values()} == {frozenset({"disk"})}


def _ops(seed: int, tiers: bool) -> list[tuple]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(5, 60) for _ in range(12)] for _ in range(3)]
    ops: list[tuple] = []
    for _ in range(rng.randrange(6, 14)):
        r = rng.random()
        if r < 0.08:
            ops.append(("reset",))
        elif r < 0.16:
            ops.append(("caching", rng.random() < 0.5))
        elif tiers and r < 0.22:
            ops.append(("flush",))
        elif tiers and r < 0.28:
            ops.append(("restart", rng.randrange(6, 12), rng.choice((0, 2, 5))))
        elif tiers and r < 0.32:
            ops.append(("corrupt", rng.randrange(10**6)))
        else:
            prompts = [
                prefixes[rng.randrange(3)][: rng.randrange(4, 13)]
                + [rng.randrange(5, 60) for _ in range(rng.randrange(0, 9))]
                for _ in range(rng.randrange(1, 4))
            ]
            ops.append(("run", prompts))
    return ops


def _corrupt(disk_dir: str, pick: int) -> None:
    files = sorted(p for p in Path(disk_dir).iterdir() if p.name.endswith(DISK_SUFFIX))
    if files:
        f = files[pick % len(files)]
        raw = bytearray(f.read_bytes())
        raw[pick % len(raw)] ^= 0x5A
        f.write_bytes(bytes(raw))


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    seed=st.integers(0, 2**32 - 1),
    num_blocks=st.integers(6, 12),
    host_blocks=st.sampled_from((0, 2, 5)),
    disk_blocks=st.sampled_from((None, 3, 30)),
    write_through=st.booleans(),
    loss=st.sampled_from((0.0, 0.2)),
    events_on_late=st.booleans(),
)
def test_tree_from_events_equals_the_pool_and_tiers_after_every_step(
    seed, num_blocks, host_blocks, disk_blocks, write_through, loss, events_on_late
):
    with tempfile.TemporaryDirectory() as d:
        disk_dir = None if disk_blocks is None else d

        def make(blocks: int, host: int) -> LLMEngine:
            return _tiered_engine(blocks, host, disk_dir, disk_blocks or 0, write_through)

        engine = make(num_blocks, host_blocks)
        rng = random.Random(seed)
        sub = Subscriber(engine)
        if not events_on_late:
            engine.enable_kv_events()
        n = 0
        for op in _ops(seed, tiers=engine.kv.tiers is not None):
            if op[0] == "run":
                for p in op[1]:
                    engine.add_request(f"q{n}", p, GREEDY)
                    n += 1
                while engine.has_unfinished_requests():
                    engine.step()
                    if engine.kv.pool.events is None:  # a subscriber attached mid-run
                        engine.enable_kv_events()
                    sub.tick(lose=rng.random() < loss)
                    sub.check()
            elif op[0] == "reset":
                engine.reset_prefix_cache()
            elif op[0] == "caching":
                engine.set_prefix_caching(op[1])
            elif op[0] == "flush":
                engine.flush_kv_tiers()
            elif op[0] == "restart":
                engine = make(op[1], op[2])
                sub.restart(engine)
            elif disk_dir is not None:
                _corrupt(disk_dir, op[1])
            if engine.kv.pool.events is None:
                engine.enable_kv_events()
            sub.tick()
            sub.check()
        media = {m for *_, m in tree_of(sub.tree).values()}
        event(f"tier-only nodes: {any('pool' not in m for m in media)}")
