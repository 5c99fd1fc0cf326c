"""Scheduler and KV invariants under random workloads, checked by brute-force recounts after
every step, on a real (tiny, random) model."""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_proc import SamplingParams
from engine_proc.core.request import SequenceStatus
from tests.engine_fixtures import tiny_engine


def check_invariants(engine, batch_tokens: int, batch_seqs: int, limits) -> None:
    pool = engine.kv.pool
    live = engine.all_sequences()
    # Brute-force recount of references from every live block table.
    refs = [0] * pool.num_blocks
    for seq in live:
        for b in seq.block_table:
            refs[b] += 1
    for block in pool.blocks:
        assert block.ref_count >= 0
        assert block.ref_count == refs[block.block_id], f"block {block.block_id}"
        assert (block.block_id in pool.free_queue) == (block.ref_count == 0)
    for h, block_id in pool.hash_to_block.items():
        assert pool.blocks[block_id].block_hash == h
    assert batch_tokens <= limits.max_num_batched_tokens
    assert batch_seqs <= limits.max_num_seqs
    for seq in engine.scheduler.running:
        assert seq.status is SequenceStatus.RUNNING
        assert len(seq.block_table) * engine.block_size >= seq.num_computed_tokens


workload = st.fixed_dictionaries(
    {
        "seed": st.integers(0, 2**16),
        "num_requests": st.integers(1, 10),
        "num_blocks": st.integers(12, 40),
        "block_size": st.sampled_from([1, 2, 4, 8]),
        "caching": st.booleans(),
    }
)


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(workload)
def test_random_workloads_keep_invariants_and_free_every_block(w):
    rng = random.Random(w["seed"])
    engine = tiny_engine(
        num_kv_blocks=w["num_blocks"],
        block_size=w["block_size"],
        enable_prefix_caching=w["caching"],
        max_num_seqs=rng.randint(1, 6),
        max_num_batched_tokens=rng.randint(8, 64),
        long_prefill_chunk=rng.choice([0, 1, 3, 16, None]),  # None: the default rule
    )
    limit = engine.max_total_tokens
    shared = [rng.randrange(128) for _ in range(rng.randint(0, 24))]
    pending = []
    for i in range(w["num_requests"]):
        own = [rng.randrange(128) for _ in range(rng.randint(1, 20))]
        prompt = (shared + own)[: limit - 1]
        params = SamplingParams(
            max_tokens=rng.randint(1, 12),
            temperature=rng.choice([0.0, 0.8]),
            seed=rng.randrange(1000),
            n=rng.choice([1, 1, 2, 3]),
            ignore_eos=True,
        )
        pending.append((rng.randint(0, 6), f"r{i}", prompt, params))
    batches = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: batches.append(schedule()) or batches[-1]
    finished: set[str] = set()
    aborted: set[str] = set()
    step = 0
    while pending or engine.has_unfinished_requests():
        for item in [p for p in pending if p[0] <= step]:
            engine.add_request(item[1], item[2], item[3])
            pending.remove(item)
        if rng.random() < 0.1 and engine.requests:
            rid = rng.choice(sorted(engine.requests))
            for out in engine.abort_request(rid):
                assert out.finish_reason == "abort"
            aborted.add(rid)
        if rng.random() < 0.15:
            engine.set_limits(
                max_num_seqs=rng.randint(1, 6),
                max_num_batched_tokens=rng.randint(4, 64),
                long_prefill_chunk=rng.choice([0, 1, 5]),
            )
        limits = engine.scheduler.limits
        batches.clear()
        outputs = engine.step()
        (batch,) = batches
        check_invariants(engine, batch.num_tokens, len(batch.seqs), limits)
        for out in outputs:
            if out.finished:
                assert out.finish_reason in ("length", "abort", "stop")
                finished.add(out.request_id)
        step += 1
        assert step < 5000, "workload did not finish"
    assert finished | aborted >= {f"r{i}" for i in range(w["num_requests"])}
    pool = engine.kv.pool
    assert pool.num_free == pool.num_blocks
    assert all(b.ref_count == 0 for b in pool.blocks)



def _prefill_steps(engine) -> list[int]:
    """Prompt tokens of each step so far that computed any."""
    return [s.num_prefill_tokens for s in engine.stats.steps if s.num_prefill_tokens]


def _ids(n: int) -> list[int]:
    return [3 + i % 100 for i in range(n)]  # the tiny model's vocabulary is 128


def test_a_prompt_alone_takes_the_whole_budget_by_default():
    """long_prefill_chunk=None: a prompt with nothing else running or waiting is computed in
    one step (up to the token budget), since it makes no one wait."""
    engine = tiny_engine(max_num_batched_tokens=700)  # the tiny model's context: 1,024
    engine.add_request("alone", _ids(1000), SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    assert _prefill_steps(engine) == [700, 300]


def test_beside_other_requests_the_default_chunk_applies():
    from engine_proc.config import DEFAULT_PREFILL_CHUNK

    engine = tiny_engine(max_num_batched_tokens=2048)
    engine.add_request("talking", [120] * 17, SamplingParams(max_tokens=40, ignore_eos=True))
    engine.step()
    engine.add_request("long", _ids(1000), SamplingParams(max_tokens=2))
    engine.step()
    assert engine.requests["long"][0].num_computed_tokens == DEFAULT_PREFILL_CHUNK
    assert engine.is_active("talking")


def test_a_chunk_set_by_hand_applies_alone_too():
    engine = tiny_engine(long_prefill_chunk=64)
    engine.add_request("alone", _ids(200), SamplingParams(max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    assert _prefill_steps(engine) == [64, 64, 64, 8]
