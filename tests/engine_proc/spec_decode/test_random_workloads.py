"""Speculative decoding under random workloads (arrivals, aborts, live limit changes, n > 1,
small pools that preempt, chunked prompts, prefix caching on and off): after every step each
block's references are recounted from the tables, every hashed block of a sequence holds that
sequence's own tokens (never a draft), and at the end every block is free and each request
that ran to the end produced what the engine without speculation produces for it alone."""

from __future__ import annotations

import random

import pytest

from engine_proc import SamplingParams
from tests.engine_fixtures import tiny_engine

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1, "disable_by_batch_size": 0}  # fmt: skip (0: any batch drafts)


def check_blocks(engine) -> None:
    pool, bs = engine.kv.pool, engine.block_size
    refs = [0] * pool.num_blocks
    for seq in engine.all_sequences():
        assert not seq.spec_token_ids, "drafts outlived their step"
        for i, b in enumerate(seq.block_table):
            refs[b] += 1
            block = pool.blocks[b]
            if block.block_hash is not None:
                assert i < seq.num_computed_tokens // bs or i < seq.num_tokens // bs
                assert block.token_ids == tuple(seq.token_ids[i * bs : (i + 1) * bs])
        assert len(seq.block_table) == -(-seq.num_computed_tokens // bs) or seq.is_prefilling
    for block in pool.blocks:
        assert block.ref_count == refs[block.block_id], f"block {block.block_id}"
        assert (block.block_id in pool.free_queue) == (block.ref_count == 0)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(8))
def test_random_workloads(seed: int) -> None:
    rng = random.Random(seed)
    config = dict(
        num_kv_blocks=rng.randint(14, 40),
        block_size=rng.choice([1, 2, 4, 8]),
        enable_prefix_caching=rng.random() < 0.7,
        max_num_seqs=rng.randint(1, 6),
        max_num_batched_tokens=rng.randint(8, 64),
        long_prefill_chunk=rng.choice([0, 3, 16]),
    )
    engine = tiny_engine(speculative_config=SPEC, **config)
    limit = engine.max_total_tokens
    alphabet = {t: 100.0 for t in rng.sample(range(5, 60), 3)}
    requests = []
    for i in range(rng.randint(3, 8)):
        prompt = [rng.randrange(5, 12) for _ in range(rng.randint(2, 24))][: limit - 1]
        params = SamplingParams(
            max_tokens=rng.randint(1, 24),
            temperature=rng.choice([0.0, 0.9]),
            seed=rng.randrange(1000),
            n=rng.choice([1, 1, 2]),
            ignore_eos=True,
            logit_bias=alphabet if rng.random() < 0.7 else {},
            speculative=rng.random() < 0.85,
        )
        requests.append((rng.randint(0, 6), f"r{i}", prompt, params))
    pending = list(requests)
    outputs: dict[tuple[str, int], list[int]] = {}
    aborted: set[str] = set()
    step = 0
    while pending or engine.has_unfinished_requests():
        for item in [p for p in pending if p[0] <= step]:
            engine.add_request(item[1], item[2], item[3])
            pending.remove(item)
        if rng.random() < 0.04 and engine.requests:
            rid = rng.choice(sorted(engine.requests))
            engine.abort_request(rid)
            aborted.add(rid)
        if rng.random() < 0.1:
            engine.set_limits(max_num_seqs=rng.randint(1, 6),
                              max_num_batched_tokens=rng.randint(4, 64))  # fmt: skip
        for out in engine.step():
            outputs[(out.request_id, out.index)] = list(out.token_ids)
        check_blocks(engine)
        step += 1
        assert step < 5000
    assert engine.kv.pool.num_free == engine.num_blocks
    plain = tiny_engine(**config)
    for _, rid, prompt, params in requests:
        if rid in aborted:
            continue
        for out in plain.generate([prompt], params):
            assert outputs[(rid, out.index)] == out.token_ids, (rid, out.index)
    assert engine.stats.spec_decode.num_drafts > 0
