"""What the engine reports about speculation, per request (issue 35, "watch it"): each
sequence's drafts verified / confirmed (its RequestOutput, its Finish's Usage, its telemetry
RequestSnapshot) and its last speculative step's draft slots in the next snapshot.

Checked against a recount made outside the engine: a wrapper around the step's verification
notes each sequence's drafts and length before it, and its tokens after; with ignore_eos, no stop
and drafts capped below max_tokens (the scheduler's rule), a step emits exactly accepted + 1
tokens, so the accepted count is read off the emitted tokens alone."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from engine_proc import SamplingParams
from engine_proc.server.wire import finish_of, telemetry_from_snapshot
from ipc import protocol as P
from tests.engine_proc.spec_decode.test_engine_spec import ALPHABET, PROMPTS, make
from tests.tiny_models import tiny_model_dir


@pytest.fixture(scope="module")
def tiny_path():
    return tiny_model_dir(
        "llama", num_heads=4, num_kv_heads=2, num_layers=2, max_position_embeddings=1024
    )


@dataclass(slots=True)
class Verified:
    """One sequence's speculative step, as seen from outside."""

    display_id: str
    start: int  # its length before the step: the first draft's position
    drafts: list[int]
    table: list[int]  # its block table during the step (drafts' blocks included)
    emitted: list[int] = field(default_factory=list)  # its tokens from start on, after

    @property
    def accepted(self) -> int:
        return len(self.emitted) - 1


def watch(engine) -> list[list[Verified]]:
    """Wrap the engine's verification; returns the list each step's records are appended to."""
    steps: list[list[Verified]] = []
    original = engine._sample_and_emit

    def wrapped(logits, sampling):
        rec = [Verified(s.display_id, s.num_tokens, list(s.spec_token_ids), list(s.block_table))
               for s in sampling if s.spec_token_ids]  # fmt: skip
        seqs = [s for s in sampling if s.spec_token_ids]
        outs = original(logits, sampling)
        for r, s in zip(rec, seqs, strict=True):
            r.emitted = s.token_ids[r.start :]
        steps.append(rec)
        return outs

    engine._sample_and_emit = wrapped
    return steps


def params(**kw) -> list[SamplingParams]:
    kw = {"max_tokens": 41, "ignore_eos": True} | kw
    return [
        SamplingParams(logit_bias=ALPHABET, **kw),
        SamplingParams(logit_bias=ALPHABET, **kw),
        SamplingParams(**kw),  # free: drafts mostly wrong
        SamplingParams(logit_bias=ALPHABET, speculative=False, **kw),  # opted out: none
    ]


@pytest.mark.parametrize("kw", [{"temperature": 0}, {"temperature": 1.0, "seed": 4}],
                         ids=["greedy", "sampled"])  # fmt: skip
def test_per_request_counts_and_snapshot_slots(tiny_path, kw) -> None:
    engine = make(tiny_path, True)
    steps = watch(engine)
    prompts = PROMPTS + [PROMPTS[0]]
    for i, (prompt, p) in enumerate(zip(prompts, params(**kw), strict=True)):
        engine.add_request(f"r{i}", prompt, p)
    finals = {}
    snapshots_checked = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        snap = engine.snapshot()
        by_id = {r.request_id: r for r in snap.requests}
        this_step = {v.display_id: v for v in steps[-1]} if steps else {}
        for rid, r in by_id.items():
            v = this_step.get(rid)
            if v is None:  # no speculative step since the previous snapshot: no mark
                assert r.draft_blocks == [], rid
                continue
            snapshots_checked += 1
            bs = engine.block_size
            assert r.draft_start == v.start
            assert r.draft_accepted == v.accepted
            assert len(r.draft_blocks) == len(v.drafts)
            assert r.draft_blocks == [v.table[p // bs] for p in range(v.start, v.start
                                                                       + len(v.drafts))]
            # the confirmed drafts' slots are still the request's; the K/V kept ends just
            # before its newest token, so the rolled-back slots lie past num_computed_tokens
            kept = r.num_computed_tokens
            assert kept == v.start + v.accepted
            for j, b in enumerate(r.draft_blocks):
                p = v.start + j
                if p < kept:
                    assert r.block_table[p // bs] == b
                elif p // bs >= len(r.block_table):  # only rejected drafts filled it: freed
                    assert engine.kv.pool.blocks[b].ref_count == 0
        again = engine.snapshot()  # shown once: the next snapshot no longer marks them
        assert all(r.draft_blocks == [] for r in again.requests)
    assert snapshots_checked > 0

    flat = [v for step in steps for v in step]
    for v in flat:  # the recount's premise: the emitted tokens are the confirmed drafts + one
        a = v.accepted
        assert 0 <= a <= len(v.drafts) and v.emitted[:a] == v.drafts[:a]
        assert a == len(v.drafts) or v.emitted[a] != v.drafts[a]
    drafted = {rid: sum(len(v.drafts) for v in flat if v.display_id == rid) for rid in finals}
    accepted = {rid: sum(v.accepted for v in flat if v.display_id == rid) for rid in finals}
    assert drafted["r3"] == 0 and drafted["r0"] > 0
    for rid, out in finals.items():
        assert (out.num_draft_tokens, out.num_accepted_tokens) == (drafted[rid], accepted[rid])
        usage = finish_of(out, None).usage
        assert (usage.draft_tokens, usage.accepted_draft_tokens) == (drafted[rid], accepted[rid])

    c = engine.snapshot().counters
    assert c["spec_decode_num_draft_tokens"] == sum(drafted.values())
    assert c["spec_decode_num_accepted_tokens"] == sum(accepted.values())
    assert c["spec_decode_num_drafts"] == len(flat)
    total_accepted = sum(accepted.values())
    assert 0 < total_accepted < sum(drafted.values())
    for i in range(max(len(v.drafts) for v in flat)):
        assert c[f"spec_decode_num_accepted_tokens_per_pos:{i}"] == sum(
            1 for v in flat if v.accepted > i)


def test_snapshot_marks_travel_on_the_wire(tiny_path) -> None:
    """The marks and per-request counts survive the server's conversion and msgpack."""
    engine = make(tiny_path, True)
    steps = watch(engine)
    engine.add_request("w", PROMPTS[0], SamplingParams(max_tokens=30, temperature=0,
                                                       ignore_eos=True, logit_bias=ALPHABET))
    while not (steps and steps[-1]):
        engine.step()
    v = steps[-1][0]
    snap = engine.snapshot()
    wire = telemetry_from_snapshot(snap, seq=1, paused=False, num_clients=1)
    back = P.decode_pub(P.encode(wire))
    (r,) = back.requests
    assert (r.draft_start, r.draft_accepted) == (v.start, v.accepted)
    assert r.draft_blocks == [v.table[p // engine.block_size]
                              for p in range(v.start, v.start + len(v.drafts))]
    assert r.num_draft_tokens == len(v.drafts) and r.num_accepted_tokens == v.accepted
    engine.abort_request("w")


def test_a_preempted_request_shows_no_drafts(tiny_path) -> None:
    """A pool small enough to preempt, snapshots only now and then: a request preempted after
    its speculative step lost those blocks, so the next snapshot marks none for it."""
    engine = make(tiny_path, True, num_kv_blocks=40, long_prefill_chunk=8,
                  max_num_batched_tokens=24)  # fmt: skip
    steps = watch(engine)
    long_prompt = list(range(1000, 1060)) + [500, 501, 502] * 3
    p = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logit_bias=ALPHABET)
    for i, prompt in enumerate([long_prompt, PROMPTS[0], long_prompt[:40] + [500, 502],
                                PROMPTS[1]]):  # fmt: skip
        engine.add_request(f"p{i}", prompt, p)
    checked = 0
    while engine.has_unfinished_requests():
        before = engine.stats.num_preemptions
        drafted_now = {v.display_id for v in (steps[-1] if steps else [])}
        engine.step()
        if engine.stats.num_preemptions == before:
            continue
        preempted = [s for s in engine.scheduler.waiting if s.status.value == "preempted"]
        # forgotten at once: readmitted before the next snapshot, it would hold other blocks
        assert all(s.last_spec is None for s in preempted)
        snap = {r.request_id: r for r in engine.snapshot().requests}
        for s in preempted:
            assert snap[s.display_id].draft_blocks == []
            checked += s.display_id in drafted_now or s.num_draft_tokens > 0
    assert engine.stats.num_preemptions > 0 and checked > 0
