"""The engine's half of prefill/decode disaggregation (engine_proc/kv_transfer/transfer.py), two
engines in one process and no sockets: a prefill engine leases a prompt's blocks, a decode engine
adopts their bytes and continues after the first token.

Outputs are checked against transformers (greedy) and against the sampler's contract replayed on
transformers' logits (seeded sampling); block accounting by recounting the pools."""

from __future__ import annotations

import pytest

from engine_proc import SamplingParams
from engine_proc.kv_transfer.transfer import KVTransferRequest
from tests.engine_fixtures import greedy_reference, sampled_reference, tiny_engine, tiny_hf_model

BS = 16


def _run(engine, rid: str) -> list:
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


def _prefill(engine, rid: str, prompt: list[int], params: SamplingParams):
    one = SamplingParams(**{**_fields(params), "max_tokens": 1})
    engine.add_request(rid, prompt, one, kv_transfer=KVTransferRequest(do_remote_decode=True))
    (out,) = [o for o in _run(engine, rid) if o.finish_reason]
    return out


def _fields(params: SamplingParams) -> dict:
    return {k: getattr(params, k) for k in ("temperature", "top_k", "top_p", "seed", "ignore_eos")}


def _handoff(prefill, decode, rid: str, prompt: list[int], params: SamplingParams) -> tuple:
    """The router's walk: prefill with one token, pull what decode lacks, decode the rest."""
    first = _prefill(prefill, rid, prompt, params)
    assert first.finish_reason == "length" and first.kv_handoff is not None
    lease_id, hashes = first.kv_handoff
    assert len(hashes) == len(prompt) // BS
    missing = decode.transfer.missing(hashes)
    payloads = prefill.transfer.payloads(lease_id, missing)
    assert prefill.transfer.leases.release(lease_id)
    decode.add_request(
        rid,
        prompt,
        params,
        kv_transfer=KVTransferRequest(
            output_token_ids=first.token_ids, payloads=dict(zip(missing, payloads, strict=True))
        ),
    )
    outs = _run(decode, rid)
    tokens = first.token_ids + [t for o in outs for t in o.new_token_ids]
    return tokens, outs[-1], len(missing)


def _assert_pool_idle(engine) -> None:
    pool = engine.kv.pool
    assert all(b.ref_count == 0 for b in pool.blocks)
    assert pool.num_free == pool.num_blocks
    assert not engine.transfer.leases.leases


@pytest.fixture(scope="module")
def reference():
    return greedy_reference(tiny_hf_model())


@pytest.mark.parametrize("length", [5, 16, 33, 47, 64])
def test_decode_engine_continues_on_pulled_blocks_with_transformers_tokens(length, reference):
    prefill, decode = tiny_engine(), tiny_engine()
    prompt = [(7 * i + length) % 120 + 3 for i in range(length)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    tokens, last, pulled = _handoff(prefill, decode, "r", prompt, params)
    assert tokens == reference(prompt, 10)
    assert last.finish_reason == "length" and len(last.token_ids) == 10
    full = length // BS
    assert pulled == full
    assert last.num_cached_tokens == full * BS  # only the tail and the first token computed
    assert decode.transfer.stats.blocks_adopted == full
    tail = length + 1 - full * BS  # the last partial block and the first token
    assert decode.stats.prompt_tokens_total == (tail if tail > 1 else 0)
    _assert_pool_idle(prefill)
    _assert_pool_idle(decode)


def test_a_decode_engine_pulls_only_the_blocks_it_lacks(reference):
    prefill, decode = tiny_engine(), tiny_engine()
    system = [(5 * i) % 100 + 10 for i in range(48)]  # three shared blocks
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    a, _, pulled_a = _handoff(prefill, decode, "a", system + [1, 2, 3, 4] * 5, params)
    b, _, pulled_b = _handoff(prefill, decode, "b", system + [9, 8, 7, 6] * 5, params)
    assert (pulled_a, pulled_b) == (4, 1)  # b's three system blocks are already cached
    assert decode.transfer.stats.blocks_already_cached == 3
    assert a == reference(system + [1, 2, 3, 4] * 5, 6)
    assert b == reference(system + [9, 8, 7, 6] * 5, 6)
    _assert_pool_idle(decode)


def test_seeded_sampling_matches_the_colocated_contract():
    prefill, decode = tiny_engine(), tiny_engine()
    prompt = [(11 * i) % 97 + 3 for i in range(40)]
    params = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
    tokens, _, _ = _handoff(prefill, decode, "s", prompt, params)
    assert tokens == sampled_reference(tiny_hf_model())(prompt, params, 7)


def test_without_payloads_or_pool_room_the_decode_engine_recomputes(reference):
    prompt = [(3 * i) % 90 + 5 for i in range(64)]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    prefill = tiny_engine()
    first = _prefill(prefill, "x", prompt, params)
    decode = tiny_engine()  # the transfer failed: nothing pulled
    decode.add_request("x", prompt, params,
                       kv_transfer=KVTransferRequest(output_token_ids=first.token_ids))  # fmt: skip
    outs = _run(decode, "x")
    assert first.token_ids + [t for o in outs for t in o.new_token_ids] == reference(prompt, 5)
    assert outs[-1].num_cached_tokens == 0
    # A pool short of room adopts a prefix of the chain, keeping a block for the tail (else
    # the request could wait forever on blocks it holds), and computes the rest.
    lease_id, hashes = first.kv_handoff
    small = tiny_engine(num_kv_blocks=8)
    payloads = dict(zip(hashes, prefill.transfer.payloads(lease_id, hashes), strict=True))
    taken = [small.kv.pool.allocate() for _ in range(4)]  # 4 free: 3 adopted + 1 for the tail
    small.add_request("x", prompt, params, kv_transfer=KVTransferRequest(
        output_token_ids=first.token_ids, payloads=payloads))  # fmt: skip
    assert small.transfer.stats.blocks_adopted == 3
    for block in taken:
        small.kv.pool.free(block)
    outs = _run(small, "x")
    assert first.token_ids + [t for o in outs for t in o.new_token_ids] == reference(prompt, 5)
    assert outs[-1].num_cached_tokens == 3 * BS


def test_leases_hold_blocks_until_pulled_or_expired():
    engine = tiny_engine(num_kv_blocks=8)
    prompt = list(range(3, 3 + 48))
    first = _prefill(engine, "p", prompt, SamplingParams(max_tokens=1, temperature=0))
    lease_id, hashes = first.kv_handoff
    held = [b for b in engine.kv.pool.blocks if b.ref_count]
    assert len(held) == 3 and all(b.ref_count == 1 for b in held)
    # Other work cannot evict or reuse them: a prompt needing every other block still runs.
    engine.add_request("q", [i % 120 + 3 for i in range(70)], SamplingParams(max_tokens=1))
    _run(engine, "q")
    assert len(engine.transfer.payloads(lease_id, hashes)) == 3
    assert engine.transfer.leases.expire(engine.clock() + 1e6) == 1
    with pytest.raises(KeyError, match="unknown, already pulled or expired"):
        engine.transfer.payloads(lease_id, hashes)
    _assert_pool_idle(engine)


def test_a_lease_pulled_on_the_servers_thread_returns_its_blocks_at_the_loops_collect():
    """The transfer server answers pulls on its own thread: reading and ending a lease there
    never touches the pool; the blocks go back when the engine loop collects, and an expiry
    racing the pull neither frees them twice nor counts the lease as expired."""
    import threading

    engine = tiny_engine(num_kv_blocks=8)
    first = _prefill(engine, "p", list(range(3, 3 + 48)), SamplingParams(max_tokens=1))
    lease_id, hashes = first.kv_handoff
    leases = engine.transfer.leases
    got: list = []

    def server_thread() -> None:
        got.extend(engine.transfer.payloads(lease_id, hashes))
        got.append(leases.take(lease_id))

    t = threading.Thread(target=server_thread)
    t.start()
    t.join()
    assert len(got) == 4 and got[-1] is True
    assert not leases.holds(lease_id) and not leases.take(lease_id)  # ended once
    assert sum(1 for b in engine.kv.pool.blocks if b.ref_count) == 3  # still held...
    assert leases.expire(engine.clock() + 1e6) == 0  # ...not expired: it was pulled
    assert leases.collect() == 1  # the loop frees them
    assert leases.stats.leases_pulled == 1 and leases.stats.leases_expired == 0
    _assert_pool_idle(engine)


def test_aborting_a_handed_over_request_frees_its_held_blocks():
    prefill, decode = tiny_engine(), tiny_engine()
    prompt = list(range(3, 3 + 40))
    first = _prefill(prefill, "a", prompt, SamplingParams(max_tokens=1, temperature=0))
    lease_id, hashes = first.kv_handoff
    payloads = dict(zip(hashes, prefill.transfer.payloads(lease_id, hashes), strict=True))
    decode.add_request("a", prompt, SamplingParams(max_tokens=5), kv_transfer=KVTransferRequest(
        output_token_ids=first.token_ids, payloads=payloads))  # fmt: skip
    assert sum(b.ref_count for b in decode.kv.pool.blocks) == 2
    decode.abort_request("a")
    _assert_pool_idle(decode)


@pytest.mark.parametrize(
    "given, params, match",
    [
        ([500], SamplingParams(max_tokens=4), r"output_token_ids must be in \[0, 128\)"),
        ([5], SamplingParams(max_tokens=1), "fewer tokens than max_tokens"),
    ],
)
def test_bad_handed_over_tokens_are_refused(given, params, match):
    engine = tiny_engine()
    with pytest.raises(ValueError, match=match):
        engine.add_request("b", [1, 2, 3], params,
                           kv_transfer=KVTransferRequest(output_token_ids=given))  # fmt: skip
    assert not engine.has_unfinished_requests()


@pytest.mark.slow
def test_default_model_disaggregated_equals_transformers_on_the_parity_prompts(
    default_engine_factory, parity_references
):
    prefill = default_engine_factory(dtype="float32")
    decode = default_engine_factory(dtype="float32")
    prompt_ids, refs = parity_references
    # The first 16 of transformers' PARITY_TOKENS greedy tokens (the suite's time budget).
    refs = [ref[:16] for ref in refs]
    params = SamplingParams(max_tokens=16, temperature=0)
    one = SamplingParams(max_tokens=1, temperature=0)
    for i, ids in enumerate(prompt_ids):  # all prompts in one batch on each side
        prefill.add_request(f"p{i}", ids, one, kv_transfer=KVTransferRequest(do_remote_decode=True))
    firsts = {}
    while prefill.has_unfinished_requests():
        firsts |= {o.request_id: o for o in prefill.step() if o.finish_reason}
    handed = {}
    for i, ids in enumerate(prompt_ids):
        first = firsts[f"p{i}"]
        if first.finish_reason == "stop":  # EOS first: nothing to hand over
            assert first.token_ids == refs[i]
            continue
        lease_id, hashes = first.kv_handoff
        missing = decode.transfer.missing(hashes)
        payloads = dict(zip(missing, prefill.transfer.payloads(lease_id, missing), strict=True))
        prefill.transfer.leases.release(lease_id)
        decode.add_request(f"p{i}", ids, params, kv_transfer=KVTransferRequest(
            output_token_ids=first.token_ids, payloads=payloads))  # fmt: skip
        handed[f"p{i}"] = list(first.token_ids)
    last = {}
    while decode.has_unfinished_requests():
        for o in decode.step():
            handed[o.request_id] += o.new_token_ids
            if o.finish_reason:
                last[o.request_id] = o
    assert len(handed) >= 6
    for rid, tokens in handed.items():
        i = int(rid[1:])
        assert tokens == refs[i], i
        assert last[rid].num_cached_tokens == len(prompt_ids[i]) // BS * BS
    _assert_pool_idle(prefill)
    _assert_pool_idle(decode)
