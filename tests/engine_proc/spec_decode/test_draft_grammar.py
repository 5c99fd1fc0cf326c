"""A draft model under structured output: each draft request follows the target sequence's
grammar where the target is in it (engine_proc/structured/draft.py). Every draft proposed is a
token the grammar allows at its position (checked by an xgrammar matcher built here from the
same constraints), greedy tokens are the plain engine's, at least as many drafts are accepted as
with unconstrained drafts, and neither engine keeps a block or a matcher once requests finish
or are aborted mid-reply."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from engine_proc import LLMEngine, SamplingParams
from ipc.messages import StructuredOutput
from tests.engine_proc.spec_decode.test_draft_model import (
    SHAPE,
    assert_draft_pool_free,
    make,
)
from tests.engine_proc.spec_decode.test_engine_spec import PROMPTS, SCHEMA, run, spec_counts
from tests.tiny_models import tiny_model_dir

REGEX = r"[a-c]{2}(-[0-9]{2}){5}"
OBJECT = {"type": "object", "additionalProperties": False, "required": ["n", "tag"],
          "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                         "tag": {"enum": ["red", "green", "blue"]}}}  # fmt: skip
CONSTRAINTS = [("json", json.dumps(SCHEMA)), ("regex", REGEX), ("json", json.dumps(OBJECT))]


@pytest.fixture(scope="module")
def target_path():
    return tiny_model_dir("llama", **SHAPE)


@pytest.fixture(scope="module")
def plain(target_path):
    return make(target_path)


@pytest.fixture(scope="module")
def drafting(target_path):
    """A random draft model a quarter of the target's width (test_draft_model's)."""
    draft = tiny_model_dir("llama", num_heads=2, num_kv_heads=1, num_layers=1, hidden_size=32,
                           intermediate_size=64, max_position_embeddings=1024, seed=7)  # fmt: skip
    return make(target_path, draft)


def workload(**kw) -> tuple[list[list[int]], list[SamplingParams]]:
    kw = {"max_tokens": 120, "temperature": 0} | kw
    params = [SamplingParams(structured=StructuredOutput(kind=kind, spec=spec,
                                                         field="response_format"), **kw)
              for kind, spec in CONSTRAINTS]  # fmt: skip
    return [PROMPTS[0], PROMPTS[1], PROMPTS[2]], params


def compiled_grammars(engine: LLMEngine) -> list:
    """The constraints compiled here, as the engine compiles them (no free whitespace)."""
    stop = sorted(engine.eos_token_ids)
    vocab = engine.model_config.vocab_size
    info = xgr.TokenizerInfo.from_huggingface(engine.tokenizer, vocab_size=vocab,
                                              stop_token_ids=stop)  # fmt: skip
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    out = []
    for kind, spec in CONSTRAINTS:
        if kind == "json":
            out.append(compiler.compile_json_schema(spec, any_whitespace=False, strict_mode=True))
        else:
            out.append(compiler.compile_regex(spec))
    return out


def record_drafts(engine: LLMEngine) -> list[tuple[str, list[int], list[int]]]:
    """(request id, its outputs then, the drafts) of every proposal the scheduler gets."""
    seen: list[tuple[str, list[int], list[int]]] = []
    propose = engine.scheduler.propose

    def recording(seq, k):
        drafts = propose(seq, k)
        if drafts:
            seen.append((seq.request_id, list(seq.output_token_ids), list(drafts)))
        return drafts

    engine.scheduler.propose = recording
    return seen


def assert_no_state(engine: LLMEngine) -> None:
    assert not engine.requests and engine.kv.pool.num_free == engine.num_blocks
    assert_draft_pool_free(engine)
    assert engine.proposer.constraints.tracked == {}, "grammar state kept after the requests"


def test_every_draft_is_allowed_by_the_grammar(drafting) -> None:
    """Without the target's grammar, the random draft model proposes tokens the grammar
    refuses at the first draft already (this test fails there)."""
    compiled = compiled_grammars(drafting)
    seen = record_drafts(drafting)
    prompts, params = workload()
    try:
        outs = run(drafting, prompts, params)
    finally:
        drafting.scheduler.propose = drafting._propose
    grammar_of = {o.request_id: g for o, g in zip(outs, compiled, strict=True)}
    assert len({rid for rid, _, _ in seen}) == len(CONSTRAINTS), "some request never drafted"
    for rid, outputs, drafts in seen:
        m = xgr.GrammarMatcher(grammar_of[rid])
        for token in outputs:
            assert m.accept_token(token)
        for i, token in enumerate(drafts):
            assert not m.is_terminated() and m.accept_token(token), (
                f"{rid}: draft {i} ({token}) refused after {len(outputs)} outputs, {drafts}"
            )
    assert_no_state(drafting)


def test_greedy_tokens_are_the_plain_engines(plain, drafting) -> None:
    prompts, params = workload()
    want = run(plain, prompts, params)
    got = run(drafting, prompts, params)
    assert [(g.token_ids, g.text, g.finish_reason) for g in got] == [
        (w.token_ids, w.text, w.finish_reason) for w in want
    ]
    assert all(w.finish_reason == "stop" for w in want)  # each grammar completed
    json.loads(got[0].text)
    assert_no_state(drafting)


def test_acceptance_is_no_lower_than_with_unconstrained_drafts(drafting) -> None:
    """The same workload with the draft requests' grammars taken away (as before drafts
    followed grammars), then with them. Prints both rates."""
    prompts, params = workload()
    rates = {}
    constraints = drafting.proposer.constraints
    for name in ("unconstrained", "constrained"):
        drafting.proposer.constraints = constraints if name == "constrained" else None
        drafted, accepted = spec_counts(drafting)
        try:
            run(drafting, prompts, params)
        finally:
            drafting.proposer.constraints = constraints
        drafted, accepted = spec_counts(drafting)[0] - drafted, spec_counts(drafting)[1] - accepted
        rates[name] = (accepted, drafted, accepted / drafted)
    print(f"\nacceptance under the grammars: {rates}")
    assert rates["constrained"][2] >= rates["unconstrained"][2]
    assert_no_state(drafting)


def test_no_leak_after_an_abort_mid_reply(drafting) -> None:
    prompts, params = workload()
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        drafting.add_request(f"abort-{i}", prompt, p)
    tracked = drafting.proposer.constraints.tracked
    for _ in range(50):  # until both JSON requests have drafted under their grammar
        if ("abort-0", 0) in tracked and ("abort-2", 0) in tracked:
            break
        drafting.step()
    assert all(drafting.requests[r][0].num_output_tokens > 0 for r in ("abort-0", "abort-2"))
    drafting.abort_request("abort-0")
    assert ("abort-0", 0) not in tracked  # dropped with the sequence, not at some later step
    while drafting.has_unfinished_requests():
        drafting.step()
    assert_no_state(drafting)
    drafting.add_request("abort-3", prompts[1], params[1])
    drafting.step()
    drafting.step()
    drafting.abort_request("abort-3")
    assert_no_state(drafting)


class BrokenMatcher:
    """A matcher that fails however it is used (an xgrammar error, a bug)."""

    def __getattr__(self, name: str):
        raise RuntimeError(f"broken matcher: {name}")


def test_a_failing_grammar_leaves_the_others_constrained(plain, drafting, caplog) -> None:
    """One sequence's draft grammar fails: its drafts go unconstrained (never its tokens: the
    target's rows are masked), the other sequences' drafts still follow their grammars."""
    compiled = compiled_grammars(drafting)
    prompts, params = workload()
    want = run(plain, prompts, params)
    rids = [f"broken-{i}" for i in range(len(prompts))]
    for rid, prompt, p in zip(rids, prompts, params, strict=True):
        drafting.add_request(rid, prompt, p)
    tracked = drafting.proposer.constraints.tracked
    for _ in range(50):
        if all((rid, 0) in tracked for rid in rids):
            break
        drafting.step()
    tracked[(rids[0], 0)].matcher = BrokenMatcher()
    caplog.set_level("WARNING", logger="engine_proc.structured.draft")
    seen = record_drafts(drafting)
    got: dict[str, list[int]] = {}
    try:
        while drafting.has_unfinished_requests():
            for out in drafting.step():
                if out.finished:
                    got[out.request_id] = list(out.token_ids)
    finally:
        drafting.scheduler.propose = drafting._propose
    assert [got[rid] for rid in rids] == [w.token_ids for w in want]
    assert f"draft grammar of {rids[0]} given up: broken matcher" in caplog.text
    grammar_of = dict(zip(rids, compiled, strict=True))
    checked = 0
    for rid, outputs, drafts in seen:
        if rid == rids[0]:
            continue
        m = xgr.GrammarMatcher(grammar_of[rid])
        assert all(m.accept_token(t) for t in outputs)
        assert all(m.accept_token(t) for t in drafts), (rid, drafts)
        checked += 1
    assert checked > 0
    assert_no_state(drafting)


def test_a_failing_draft_step_costs_that_steps_drafts_only(plain, drafting, caplog) -> None:
    """The draft engine raises once mid-run: the target decodes that step without drafts, the
    draft requests of the step are aborted, and everything after is as usual."""
    draft = drafting.proposer.engine
    step = draft.step
    calls = 0

    def failing_once():
        nonlocal calls
        calls += 1
        if calls == 5:
            step()  # a step that ran, then failed before its outputs were taken
            raise RuntimeError("draft step failed")
        return step()

    prompts, params = workload()
    want = run(plain, prompts, params)
    draft.step = failing_once
    try:
        got = run(drafting, prompts, params)
    finally:
        del draft.step
    assert calls > 5 and "the draft model's step failed" in caplog.text
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert_no_state(drafting)
