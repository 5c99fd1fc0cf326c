"""A random workload for KV layouts (shared by the hybrid and the all-sliding tests): prompts
sharing prefixes, n > 1, aborts, preemption and eviction on a tiny pool, checked after every
step against a brute-force recount of every block's references, and at the end against the
replies of a roomy engine that keeps every block."""

from __future__ import annotations

import random
from collections.abc import Callable

from engine_proc import LLMEngine, SamplingParams
from engine_proc.core.kv_cache_manager import NO_BLOCK


def prompt_of(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


def recount(engine: LLMEngine) -> dict[int, int]:
    """Block id -> the number of tables of unfinished sequences holding it."""
    refs: dict[int, int] = {}
    for seqs in engine.requests.values():
        for seq in seqs:
            if seq.is_finished:
                continue
            for table in (seq.block_table, *seq.group_tables):
                for b in table:
                    if b != NO_BLOCK:
                        refs[b] = refs.get(b, 0) + 1
    return refs


def check_random_workload(make: Callable[..., LLMEngine], seed: int,
                          pool: tuple[int, int]) -> None:  # fmt: skip
    """`make(hybrid=..., **config)` builds an engine of the model under test; `pool`: the range
    the tight engine's block count is drawn from."""
    rng = random.Random(seed)
    shared = prompt_of(100 + seed, rng.randrange(20, 70))
    jobs = []
    for i in range(8):
        head = shared if rng.random() < 0.6 else []
        prompt = head + prompt_of(seed * 50 + i, rng.randrange(5, 90))
        jobs.append((f"r{i}", prompt, SamplingParams(max_tokens=rng.randrange(4, 30),
                                                      n=rng.choice((1, 1, 2)), temperature=0,
                                                      ignore_eos=True)))  # fmt: skip
    # the replies of a roomy keep-everything engine, all jobs in one batch (outputs in prompt
    # order, n per prompt)
    outs = iter(make(hybrid=False).generate([p for _, p, _ in jobs],
                                            [params for *_, params in jobs]))  # fmt: skip
    want = {rid: [next(outs).token_ids for _ in range(params.n)] for rid, _, params in jobs}
    tight = make(num_kv_blocks=rng.randrange(*pool), max_num_seqs=6)
    blocks = tight.kv.pool
    aborted = set(rng.sample([rid for rid, _, _ in jobs], 2))
    got: dict[str, dict[int, list[int]]] = {}
    pending, steps = list(jobs), 0
    while pending or tight.has_unfinished_requests():
        if pending and rng.random() < 0.5:
            tight.add_request(*pending.pop(0))
        for out in tight.step():
            got.setdefault(out.request_id, {})[out.index] = out.token_ids
        steps += 1
        if steps == 6:
            for rid in aborted:
                if tight.is_active(rid):
                    tight.abort_request(rid)
        refs = recount(tight)
        for block in blocks.blocks:
            assert block.ref_count == refs.get(block.block_id, 0), (steps, block)
        assert blocks.num_free == blocks.num_blocks - len(refs)
    assert blocks.num_free == blocks.num_blocks
    for rid, by_index in got.items():
        if rid not in aborted:
            assert [by_index[i] for i in sorted(by_index)] == want[rid], rid
