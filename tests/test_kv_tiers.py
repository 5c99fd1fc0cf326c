"""Lower KV tiers (engine_proc/kv_tiers.py): host and disk tiers below the pool, write-back on
eviction, lookups pool -> host -> disk, entries that persist across engine restarts.

Outputs are checked against transformers' greedy generation and against an engine without
prefix caching (which recomputes everything); the disk format against an independent parse of
the documented header."""

from __future__ import annotations

import hashlib
import os
import random
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engine_proc import EngineConfig, LLMEngine, SamplingParams
from engine_proc.kv_tiers import DISK_SUFFIX, DiskTier, HostTier, model_fingerprint
from tests.engine_fixtures import greedy_reference, tiny_engine
from tests.tiny_models import hf_reference_model, tiny_model_dir

REPO = Path(__file__).resolve().parents[1]
GREEDY = SamplingParams(max_tokens=4, temperature=0)


# ----------------------------------------------------------------------------- unit: tiers
def _identity() -> bytes:
    return hashlib.sha256(b"test identity").digest()


def _h(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def test_host_tier_is_lru_and_copies_whole_blocks():
    host = HostTier(2, (2, 2, 3), torch.float32, pin=False)
    blocks = [torch.full((2, 2, 3), float(i)) for i in range(3)]
    host.store(_h(0), blocks[0])
    host.store(_h(1), blocks[1])
    out = torch.empty(2, 2, 3)
    assert host.load(_h(0), out) and torch.equal(out, blocks[0])  # 0 is now most recent
    host.store(_h(2), blocks[2])  # evicts 1, the least recently used
    assert _h(1) not in host and _h(0) in host and _h(2) in host
    assert not host.load(_h(1), out)
    assert host.load(_h(2), out) and torch.equal(out, blocks[2])
    host.check()


def test_disk_entry_layout_is_the_documented_header(tmp_path):
    payload = bytes(range(256)) * 4
    disk = DiskTier(str(tmp_path), 10**6, _identity(), len(payload))
    assert disk.store(_h(1), payload)
    raw = (tmp_path / (_h(1).hex() + DISK_SUFFIX)).read_bytes()
    # Independent parse: magic, format u32, identity, block hash, length u64, sha256, payload.
    magic, fmt, ident, h, n, digest = struct.unpack("<12sI32s32sQ32s", raw[:120])
    assert (magic, fmt, ident, h, n) == (b"KVSCOPE-KVB\0", 1, _identity(), _h(1), len(payload))
    assert digest == hashlib.sha256(payload).digest() and raw[120:] == payload
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    assert disk.load(_h(1)) == payload


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign", "renamed"])
def test_damaged_or_foreign_disk_entries_are_misses(tmp_path, damage):
    payload = os.urandom(512)
    disk = DiskTier(str(tmp_path), 10**6, _identity(), len(payload))
    disk.store(_h(1), payload)
    path = disk.path(_h(1))
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[200] ^= 0x40
        path.write_bytes(bytes(raw))
    elif damage == "truncate":
        path.write_bytes(bytes(raw[:300]))
    elif damage == "foreign":
        foreign = DiskTier(str(tmp_path / "f"), 10**6, hashlib.sha256(b"other").digest(), 512)
        foreign.store(_h(1), payload)
        path.write_bytes(foreign.path(_h(1)).read_bytes())
    else:  # a valid entry under another block's name
        path.rename(disk.path(_h(2)))
    for fresh in (False, True):  # found by the running tier at load, or by a restart's scan
        tier = DiskTier(str(tmp_path), 10**6, _identity(), len(payload)) if fresh else disk
        assert tier.load(_h(1)) is None and tier.load(_h(2)) is None
        tier.check()
    if damage in ("flip", "truncate"):
        assert not path.exists()  # a broken entry of ours is removed
    if damage == "foreign":
        assert path.exists()  # another engine's entry is left alone


def test_a_crash_mid_write_leaves_no_entry(tmp_path):
    payload = os.urandom(256)
    disk = DiskTier(str(tmp_path), 10**6, _identity(), len(payload))
    disk.store(_h(1), payload)
    good = disk.path(_h(1)).read_bytes()
    # What a writer killed before its rename leaves: a temp file, possibly complete.
    (tmp_path / f".tmp-{_h(2).hex()}-123-1").write_bytes(good[:100])
    (tmp_path / f".tmp-{_h(3).hex()}-123-2").write_bytes(good)
    again = DiskTier(str(tmp_path), 10**6, _identity(), len(payload))
    assert list(again.index) == [_h(1)]
    assert again.load(_h(2)) is None and again.load(_h(3)) is None


def test_disk_capacity_is_lru_and_a_full_disk_stops_writes_not_reads(tmp_path, monkeypatch):
    payload = os.urandom(100)
    entry = 120 + 100
    disk = DiskTier(str(tmp_path), 2 * entry, _identity(), 100)
    for i in range(3):
        assert disk.store(_h(i), payload)
    assert list(disk.index) == [_h(1), _h(2)] and not disk.path(_h(0)).exists()
    disk.check()

    def full(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    assert not disk.store(_h(9), payload)
    monkeypatch.undo()
    assert not disk.writable and disk.stats.write_errors == 1
    assert not disk.store(_h(10), payload)  # writes stay stopped
    assert disk.load(_h(2)) == payload  # serving from what is there goes on
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    disk.check()


@pytest.mark.slow
def test_model_fingerprint_is_the_same_in_every_process(tmp_path):
    f = tmp_path / "model.gguf"
    f.write_bytes(os.urandom(200_000))
    code = (
        f"from engine_proc.kv_tiers import model_fingerprint\nprint(model_fingerprint({str(f)!r}))"
    )
    outs = set()
    for seed in ("0", "77"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO)}
        outs.add(
            subprocess.run(
                [sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True,
                timeout=120, check=True,
            ).stdout.strip()
        )  # fmt: skip
    assert outs == {model_fingerprint(str(f))}
    data = bytearray(f.read_bytes())
    data[-1] ^= 1  # another revision of the weights
    f.write_bytes(bytes(data))
    assert model_fingerprint(str(f)) not in outs


# ----------------------------------------------------------------------------- engine level
@pytest.fixture(scope="module")
def tiny_path():
    return tiny_model_dir(
        "llama", num_heads=4, num_kv_heads=2, num_layers=2, max_position_embeddings=1024
    )


@pytest.fixture(scope="module")
def hf_greedy(tiny_path):
    return greedy_reference(hf_reference_model(tiny_path))


def _prompts(num_systems: int, rounds: int, system_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [
        [1] + [rng.randrange(3, 49152) for _ in range(system_len)] for _ in range(num_systems)
    ]
    # Each system once, then in random order: some come back soon (a host hit), some late.
    order = list(range(num_systems)) + [
        rng.randrange(num_systems) for _ in range(num_systems * (rounds - 1))
    ]
    tails = [[rng.randrange(3, 49152) for _ in range(rng.randrange(1, 6))] for _ in order]
    return [systems[i] + tail for i, tail in zip(order, tails, strict=True)]


def _run_one_by_one(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    outs = []
    for p in prompts:
        (out,) = engine.generate([p], GREEDY)
        outs.append(out.token_ids)
    return outs


@pytest.mark.slow
def test_tiers_on_give_the_same_tokens_as_tiers_off_and_transformers(tiny_path, hf_greedy):
    # 8 system prompts of 12 blocks in rotation over a pool that holds about 2 of them: every
    # round evicts each prefix and reloads it, from the host tier (about 3 prefixes) or disk.
    prompts = _prompts(num_systems=8, rounds=3, system_len=48, seed=3)
    common = dict(model=str(tiny_path), block_size=4, num_kv_blocks=28)
    off = LLMEngine(EngineConfig(**common, enable_prefix_caching=False))
    expected = _run_one_by_one(off, prompts)
    for i in (0, 9, 23):
        assert expected[i] == hf_greedy(prompts[i], GREEDY.max_tokens)
    with tempfile.TemporaryDirectory() as d:
        probe = LLMEngine(EngineConfig(**common))
        host_bytes = 36 * probe.block_bytes
        on = LLMEngine(EngineConfig(**common, kv_host_memory=host_bytes, kv_disk_dir=d))
        assert _run_one_by_one(on, prompts) == expected
        c = on.snapshot().counters
        assert c["kv_host_hits"] > 0 and c["kv_disk_hits"] > 0
        loads = on.kv.tiers.loads
        assert sum(loads.values()) > len(loads) > 0  # blocks reloaded again and again
        assert c["external_prefix_cache_hits"] == 4 * (c["kv_host_hits"] + c["kv_disk_hits"])
        assert c["prefix_cache_hits"] >= c["external_prefix_cache_hits"] > 0
        on.kv.tiers.check()
        # Without tiers the same pool recomputes every prefix.
        plain = LLMEngine(EngineConfig(**common))
        assert _run_one_by_one(plain, prompts) == expected
        assert plain.stats.prefix_cache_hits < c["prefix_cache_hits"]


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_a_restarted_engine_hits_from_disk(tiny_path, hf_greedy, policy):
    prompts = _prompts(num_systems=4, rounds=1, system_len=40, seed=5)
    common = dict(model=str(tiny_path), block_size=4, num_kv_blocks=24, kv_tier_policy=policy)
    with tempfile.TemporaryDirectory() as d:
        first = LLMEngine(EngineConfig(**common, kv_disk_dir=d))
        before = _run_one_by_one(first, prompts)
        del first
        second = LLMEngine(EngineConfig(**common, kv_disk_dir=d))
        # With write-back only evicted prefixes reached the disk: the first ones.
        (out,) = second.generate([prompts[0]], GREEDY)
        assert out.num_cached_tokens == 40  # 10 full blocks of 41 prompt tokens ... at least
        assert out.token_ids == before[0] == hf_greedy(prompts[0], GREEDY.max_tokens)
        c = second.snapshot().counters
        assert c["kv_disk_hits"] == 10 and c["external_prefix_cache_hits"] == 40
        # Write-back leaves a prefix whose first blocks stayed in the pool off the disk; a
        # flush at shutdown writes them down.
        fresh = _prompts(num_systems=1, rounds=1, system_len=40, seed=11)[0]
        third = LLMEngine(EngineConfig(**common, kv_disk_dir=d))
        (once,) = third.generate([fresh], GREEDY)  # fits the pool: nothing evicted
        assert third.flush_kv_tiers() > 0
        fourth = LLMEngine(EngineConfig(**common, kv_disk_dir=d))
        (out,) = fourth.generate([fresh], GREEDY)
        assert out.num_cached_tokens == (len(fresh) - 1) // 4 * 4 >= 40
        assert out.token_ids == once.token_ids == hf_greedy(fresh, GREEDY.max_tokens)
        # Another block size, or another dtype, is another chain root: no hits, right tokens.
        for change in (dict(block_size=8), dict(dtype="bfloat16")):
            other = LLMEngine(EngineConfig(**(common | change), kv_disk_dir=d))
            (out,) = other.generate([prompts[0]], GREEDY)
            assert out.num_cached_tokens == 0
            if "dtype" not in change:
                assert out.token_ids == before[0]


# ----------------------------------------------------------------------------- property test
_REF: dict[tuple[int, ...], list[int]] = {}
_REF_ENGINE: list[LLMEngine] = []
_BASES = [[random.Random(b).randrange(3, 128) for _ in range(24)] for b in range(4)]


def _reference(prompt: list[int]) -> list[int]:
    key = tuple(prompt)
    if key not in _REF:
        if not _REF_ENGINE:
            _REF_ENGINE.append(tiny_engine(block_size=4, enable_prefix_caching=False))
        _REF[key] = _REF_ENGINE[0].generate([prompt], GREEDY)[0].token_ids
    return _REF[key]


def _check_pool(engine: LLMEngine) -> None:
    pool = engine.kv.pool
    refs = [0] * pool.num_blocks
    for seq in engine.all_sequences():
        for b in seq.block_table:
            refs[b] += 1
    assert [b.ref_count for b in pool.blocks] == refs
    assert set(pool.free_queue) == {b.block_id for b in pool.blocks if b.ref_count == 0}
    for h, bid in pool.hash_to_block.items():
        assert pool.blocks[bid].block_hash == h
    assert sum(b.block_hash is not None for b in pool.blocks) == len(pool.hash_to_block)


def _watch_loads(engine: LLMEngine) -> None:
    """Every load must be of a block the pool does not hold (so never loaded twice)."""
    tiers = engine.kv.tiers
    load = tiers.load

    def checked(block_hash: bytes, block_id: int) -> str | None:
        assert engine.kv.pool.lookup(block_hash) is None, "loaded a block the pool holds"
        assert engine.kv.pool.blocks[block_id].ref_count == 1  # pinned while it loads
        return load(block_hash, block_id)

    tiers.load = checked


def _workload(seed: int) -> list[tuple]:
    """Runs of 1-4 concurrent prompts over 4 shared prefixes (more blocks than the pool holds),
    with engine restarts and a disk entry corrupted now and then."""
    rng = random.Random(seed)
    ops: list[tuple] = []
    for _ in range(rng.randrange(5, 10)):
        r = rng.random()
        if r < 0.12:
            ops.append(("restart", rng.randrange(10, 15)))
        elif r < 0.25:  # then a run of every prefix, which may meet the damaged entry
            ops.append(("corrupt", rng.randrange(10**6)))
            ops.append(("run", [(b, 24, []) for b in range(4)]))
        else:
            ops.append(("run", [
                (rng.randrange(4), rng.randrange(6, 25),
                 [rng.choice((5, 6)) for _ in range(rng.randrange(3))])
                for _ in range(rng.randrange(1, 5))
            ]))  # fmt: skip
    return ops


@pytest.mark.slow
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    seed=st.integers(0, 2**32 - 1),
    host_blocks=st.sampled_from((0, 3, 8)),
    disk_blocks=st.sampled_from((None, 0, 6, 40)),
    write_through=st.booleans(),
    num_blocks=st.integers(10, 14),
)
def test_random_workloads_keep_counts_and_files_consistent(
    seed, host_blocks, disk_blocks, write_through, num_blocks
):
    ops = _workload(seed)
    with tempfile.TemporaryDirectory() as d:
        probe = tiny_engine(block_size=4, num_kv_blocks=1)
        block_bytes = probe.block_bytes
        entry_bytes = block_bytes + 120

        def make(blocks: int) -> LLMEngine:
            engine = tiny_engine(
                block_size=4,
                num_kv_blocks=blocks,
                kv_host_memory=host_blocks * block_bytes,
                kv_disk_dir=None if disk_blocks is None else d,
                kv_disk_bytes=(disk_blocks or 0) * entry_bytes,
                kv_tier_policy="write_through" if write_through else "write_back",
            )
            if engine.kv.tiers is not None:
                _watch_loads(engine)
            return engine

        engine = make(num_blocks)
        totals: dict[str, float] = {}
        rng = random.Random(len(ops))
        for op in ops:
            if op[0] == "run":
                prompts = [_BASES[b][:n] + tail for b, n, tail in op[1]]
                for i, p in enumerate(prompts):
                    engine.add_request(f"q{i}", p, GREEDY)
                done = {}
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        if out.finished:
                            done[out.request_id] = out.token_ids
                    _check_pool(engine)
                assert [done[f"q{i}"] for i in range(len(prompts))] == [
                    _reference(p) for p in prompts
                ]
                assert engine.kv.pool.num_free == engine.num_blocks  # nothing leaked
            elif op[0] == "restart":
                _add_counters(totals, engine)
                engine = make(op[1])
            elif disk_blocks is not None:  # corrupt a random disk entry (flip or truncate)
                files = sorted(p for p in Path(d).iterdir() if p.name.endswith(DISK_SUFFIX))
                if files:
                    f = files[op[1] % len(files)]
                    raw = bytearray(f.read_bytes())
                    if rng.random() < 0.5:
                        raw[op[1] % len(raw)] ^= 0x5A
                        f.write_bytes(bytes(raw))
                    else:
                        f.write_bytes(bytes(raw[: op[1] % len(raw)]))
            if engine.kv.tiers is not None and op[0] != "corrupt":
                engine.kv.tiers.check()
        _add_counters(totals, engine)
        for name in ("kv_host_hits", "kv_disk_hits", "kv_disk_corrupt_entries"):
            event(f"{name} > 0: {totals.get(name, 0) > 0}")


def _add_counters(totals: dict[str, float], engine: LLMEngine) -> None:
    if engine.kv.tiers is not None:
        for k, v in engine.kv.tiers.counters().items():
            totals[k] = totals.get(k, 0) + v
