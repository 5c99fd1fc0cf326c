"""Lower KV tiers (engine_proc/kv_store/tiers.py): host and disk tiers below the pool, write-back on
eviction, lookups pool -> host -> disk, entries that persist across engine restarts, for the
model-dtype and the int8 KV cache. The tiers' parts: tests/engine_proc/kv_store/test_entry.py (what
an entry holds) and tests/engine_proc/kv_store/test_disk.py (the disk format).

Outputs are checked against transformers' greedy generation and against an engine without
prefix caching (which recomputes everything) or without tiers."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engine_proc import EngineConfig, LLMEngine, SamplingParams
from engine_proc.kv_store.disk import DISK_SUFFIX, HEADER
from engine_proc.kv_store.tiers import model_fingerprint
from tests.engine_fixtures import greedy_reference, tiny_engine
from tests.tiny_models import hf_reference_model, tiny_model_dir

REPO = Path(__file__).resolve().parents[3]
GREEDY = SamplingParams(max_tokens=4, temperature=0)


@pytest.mark.slow
def test_model_fingerprint_is_the_same_in_every_process(tmp_path):
    f = tmp_path / "model.gguf"
    f.write_bytes(os.urandom(200_000))
    code = (
        "from engine_proc.kv_store.tiers import model_fingerprint\n"
        f"print(model_fingerprint({str(f)!r}))"
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


@pytest.mark.slow
def test_int8_with_tiers_gives_the_tokens_of_int8_without(tiny_path):
    # The workload above on an int8 pool: each prefix is evicted and loaded back, values and
    # scales, from the host tier or the disk, many times over.
    prompts = _prompts(num_systems=8, rounds=3, system_len=48, seed=3)
    common = dict(model=str(tiny_path), block_size=4, num_kv_blocks=28, kv_cache_dtype="int8")
    plain = LLMEngine(EngineConfig(**common))
    expected = _run_one_by_one(plain, prompts)
    recomputed = LLMEngine(EngineConfig(**common, enable_prefix_caching=False))
    assert _run_one_by_one(recomputed, prompts[:3]) == expected[:3]
    with tempfile.TemporaryDirectory() as d:
        host_bytes = 36 * plain.block_bytes
        on = LLMEngine(EngineConfig(**common, kv_host_memory=host_bytes, kv_disk_dir=d))
        assert on.kv.tiers.block_bytes == plain.block_bytes == 4 * 2 * 2 * 2 * (16 + 2)
        assert _run_one_by_one(on, prompts) == expected
        c = on.snapshot().counters
        assert c["kv_host_hits"] > 0 and c["kv_disk_hits"] > 0
        loads = on.kv.tiers.loads
        assert sum(loads.values()) > 2 * len(loads) > 0  # blocks reloaded again and again
        assert c["kv_host_bytes_total"] == 36 * plain.block_bytes
        assert c["prefix_cache_hits"] > plain.stats.prefix_cache_hits
        on.kv.tiers.check()


@pytest.mark.slow
def test_a_restarted_int8_engine_hits_from_disk_and_fp_entries_never_mix(tiny_path):
    prompts = _prompts(num_systems=4, rounds=1, system_len=40, seed=5)
    common = dict(model=str(tiny_path), block_size=4, num_kv_blocks=24)
    int8 = dict(common, kv_cache_dtype="int8")
    expected = _run_one_by_one(LLMEngine(EngineConfig(**int8)), prompts[:1])[0]
    with tempfile.TemporaryDirectory() as d8, tempfile.TemporaryDirectory() as dfp:
        first = LLMEngine(EngineConfig(**int8, kv_disk_dir=d8))
        assert _run_one_by_one(first, prompts)[0] == expected
        del first
        second = LLMEngine(EngineConfig(**int8, kv_disk_dir=d8))
        (out,) = second.generate([prompts[0]], GREEDY)
        assert out.num_cached_tokens == 40 and out.token_ids == expected
        assert second.snapshot().counters["kv_disk_hits"] == 10
        # An fp engine's entries are another chain's: an int8 engine finds nothing there and
        # leaves the files alone, and the other way round.
        fp = LLMEngine(EngineConfig(**common, kv_disk_dir=dfp))
        _run_one_by_one(fp, prompts)
        assert fp.flush_kv_tiers() > 0
        for directory, config in ((dfp, int8), (d8, common)):
            before = {p.name: p.read_bytes() for p in Path(directory).iterdir()}
            assert before
            other = LLMEngine(EngineConfig(**config, kv_disk_dir=directory))
            assert not other.kv.tiers.disk.index
            (out,) = other.generate([prompts[0]], GREEDY)
            assert out.num_cached_tokens == 0
            assert other.snapshot().counters["kv_disk_hits"] == 0
            assert out.token_ids == (expected if config is int8 else fp.generate(
                [prompts[0]], GREEDY)[0].token_ids)
            del other
            after = {p.name: p.read_bytes() for p in Path(directory).iterdir()
                     if p.name in before}  # fmt: skip
            assert after == before


# ----------------------------------------------------------------------------- property test
_REF: dict[tuple[str, tuple[int, ...]], list[int]] = {}
_REF_ENGINE: dict[str, LLMEngine] = {}
_BASES = [[random.Random(b).randrange(3, 128) for _ in range(24)] for b in range(4)]


def _reference(prompt: list[int], kv_dtype: str) -> list[int]:
    """What an engine of this KV dtype without prefix caching (all recomputed) generates."""
    key = (kv_dtype, tuple(prompt))
    if key not in _REF:
        if kv_dtype not in _REF_ENGINE:
            _REF_ENGINE[kv_dtype] = tiny_engine(
                block_size=4, enable_prefix_caching=False, kv_cache_dtype=kv_dtype
            )
        _REF[key] = _REF_ENGINE[kv_dtype].generate([prompt], GREEDY)[0].token_ids
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


_TIER_SET_UPS = dict(
    seed=st.integers(0, 2**32 - 1),
    host_blocks=st.sampled_from((0, 3, 8)),
    disk_blocks=st.sampled_from((None, 0, 6, 40)),
    write_through=st.booleans(),
    num_blocks=st.integers(10, 14),
)
_SETTINGS = dict(deadline=None, suppress_health_check=list(HealthCheck))


@pytest.mark.slow
@settings(max_examples=12, **_SETTINGS)
@given(**_TIER_SET_UPS)
def test_random_workloads_keep_counts_and_files_consistent(
    seed, host_blocks, disk_blocks, write_through, num_blocks
):
    _random_workload("auto", seed, host_blocks, disk_blocks, write_through, num_blocks)


@pytest.mark.slow
@settings(max_examples=8, **_SETTINGS)  # int8 attention steps cost about twice as much
@given(**_TIER_SET_UPS)
def test_random_int8_workloads_keep_counts_and_files_consistent(
    seed, host_blocks, disk_blocks, write_through, num_blocks
):
    _random_workload("int8", seed, host_blocks, disk_blocks, write_through, num_blocks)


def _random_workload(
    kv_dtype: str,
    seed: int,
    host_blocks: int,
    disk_blocks: int | None,
    write_through: bool,
    num_blocks: int,
) -> None:
    """Reference outputs, reference counts, no leak, no double load and a disk index equal to
    the files after every step of a random workload (_workload)."""
    ops = _workload(seed)
    with tempfile.TemporaryDirectory() as d:
        probe = tiny_engine(block_size=4, num_kv_blocks=1, kv_cache_dtype=kv_dtype)
        block_bytes = probe.block_bytes
        entry_bytes = HEADER.size + 4 * 4 + block_bytes  # a disk entry: header, tokens, K/V

        def make(blocks: int) -> LLMEngine:
            engine = tiny_engine(
                block_size=4,
                num_kv_blocks=blocks,
                kv_host_memory=host_blocks * block_bytes,
                kv_disk_dir=None if disk_blocks is None else d,
                kv_disk_bytes=(disk_blocks or 0) * entry_bytes,
                kv_tier_policy="write_through" if write_through else "write_back",
                kv_cache_dtype=kv_dtype,
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
                    _reference(p, kv_dtype) for p in prompts
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
