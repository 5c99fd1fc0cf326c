"""Structured output in the engine, on a tiny random Llama with the default model's real
tokenizer (xgrammar needs a real vocabulary). References are independent: xgrammar's own matcher
(brute force over the vocabulary), the unconstrained engine, the `json` / `re` modules."""

from __future__ import annotations

import json
import re
import threading

import numpy as np
import pytest
import torch
import xgrammar as xgr

from engine_proc import EngineConfig, LLMEngine, SamplingParams
from engine_proc.structured.mask import allowed_tokens, apply_grammar_masks
from engine_proc.structured.matcher import SeqGrammar
from ipc.messages import StructuredOutput

SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                   "tag": {"enum": ["red", "blue"]}},
    "required": ["n", "tag"],
    "additionalProperties": False,
}  # fmt: skip
PROMPTS = ["Hello there", "The capital of France is", "1, 2, 3,"]


def _json(spec: dict = SCHEMA, field: str = "response_format") -> StructuredOutput:
    return StructuredOutput(kind="json", spec=json.dumps(spec), field=field)


@pytest.fixture(scope="module")
def engine(tiny_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_dir), dtype="float32", num_kv_blocks=256,
                                  decode_weights="dense", num_threads=1))  # fmt: skip


def _no_leak(engine: LLMEngine) -> None:
    assert not engine.requests and not engine.structured.parked
    assert engine.kv.pool.num_free == engine.num_blocks


def _brute_force(compiled, consumed: list[int], vocab: int) -> set[int]:
    """Tokens xgrammar's matcher accepts after `consumed`, one token at a time."""
    m = xgr.GrammarMatcher(compiled)
    for t in consumed:
        assert m.accept_token(t)
    ok = set()
    for t in range(vocab):
        if m.accept_token(t):
            ok.add(t)
            m.rollback(1)
    return ok


def test_mask_equals_brute_force_and_leaves_unconstrained_rows_alone(engine) -> None:
    compiler = engine.structured.compiler
    key = compiler.submit("json", json.dumps(SCHEMA), "f")
    compiler.wait_any([key], 30)
    compiled = compiler.result(key, "f").grammar
    tok = engine.tokenizer
    vocab = engine.model_config.vocab_size
    states = [[], tok('{"n": 4')["input_ids"]]
    grammars = [SeqGrammar.start("json", compiled, states[0]), None,
                SeqGrammar.start("json", compiled, states[1])]  # fmt: skip
    logits = torch.randn(3, vocab)
    masked = logits.clone()
    apply_grammar_masks(masked, grammars)
    assert torch.equal(masked[1], logits[1])
    for row, consumed in ((0, states[0]), (2, states[1])):
        want = _brute_force(compiled, consumed, vocab)
        got = set(torch.nonzero(torch.isfinite(masked[row])).flatten().tolist())
        assert got == want and 0 < len(want) < vocab
        assert torch.equal(masked[row][list(want)], logits[row][list(want)])
        assert grammars[row].allowed[-1] == len(want)
    # the helper the telemetry count relies on agrees with the bit layout
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    grammars[2].matcher.fill_next_token_bitmask(bitmask, 0)
    assert set(allowed_tokens(bitmask[0], vocab)) == _brute_force(compiled, states[1], vocab)


def test_greedy_under_a_grammar_allowing_every_token_equals_unconstrained(engine) -> None:
    plain = engine.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0))
    # `[\s\S]*` allows every token but the special ones (ids the regex cannot spell)
    special = set(engine.tokenizer.all_special_ids)
    assert all(not special & set(o.token_ids[:-1]) for o in plain)
    so = StructuredOutput(kind="regex", spec=r"[\s\S]*", field="structured_outputs.regex")
    constrained = engine.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0,
                                                          structured=so))  # fmt: skip
    assert [o.token_ids for o in constrained] == [o.token_ids for o in plain]
    _no_leak(engine)


def test_sampled_json_parses_validates_and_n2_sequences_walk_their_own_grammar(engine) -> None:
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=48, temperature=1.5, seed=3, n=2,
                                                   structured=_json()))  # fmt: skip
    assert len(outs) == 2 * len(PROMPTS)
    for o in outs:
        value = json.loads(o.text)
        assert set(value) == {"n", "tag"} and 0 <= value["n"] <= 99 and value["tag"] in SCHEMA[
            "properties"]["tag"]["enum"]  # fmt: skip
        assert o.finish_reason == "stop"
        assert o.token_ids[-1] in engine.eos_token_ids  # EOS was forced once complete
    _no_leak(engine)


def test_regex_and_choice_and_ignore_eos_finish_when_the_grammar_completes(engine) -> None:
    regex = StructuredOutput(kind="regex", spec="[a-c]{3}-[0-9]{2}", field="x")
    choice = StructuredOutput(kind="choice", spec='["yes", "no"]', field="x")
    outs = engine.generate(
        PROMPTS[:2],
        [SamplingParams(max_tokens=30, temperature=1, seed=1, structured=regex, ignore_eos=True),
         SamplingParams(max_tokens=30, temperature=1, seed=2, structured=choice)],
    )  # fmt: skip
    assert re.fullmatch("[a-c]{3}-[0-9]{2}", outs[0].text) and outs[0].finish_reason == "stop"
    assert outs[1].text in ("yes", "no")
    _no_leak(engine)


def test_preemption_keeps_every_matcher_consistent(tiny_dir) -> None:
    pattern = "([0-9] ){40,50}"  # a digit a token or two: 40 to 100 tokens each
    regex = StructuredOutput(kind="regex", spec=pattern, field="x")
    params = [SamplingParams(max_tokens=120, temperature=1, seed=i, structured=regex)
              for i in range(4)]  # fmt: skip
    roomy = LLMEngine(EngineConfig(model=str(tiny_dir), dtype="float32", num_kv_blocks=64,
                                   decode_weights="dense", num_threads=1))  # fmt: skip
    want = roomy.generate(PROMPTS + ["x"], params)
    tight = LLMEngine(EngineConfig(model=str(tiny_dir), dtype="float32", num_kv_blocks=8,
                                   block_size=16, decode_weights="dense",
                                   num_threads=1))  # fmt: skip
    got = tight.generate(PROMPTS + ["x"], params)
    assert tight.stats.num_preemptions > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert all(re.fullmatch(pattern, o.text) for o in got)
    _no_leak(tight)


def _blocked(engine: LLMEngine) -> threading.Event:
    """Hold the compile worker until the returned event is set (a deterministic 'slow'
    grammar)."""
    compiler = engine.structured.compiler
    gate = threading.Event()
    real = compiler._compile

    def slow(*args):
        gate.wait(30)
        return real(*args)

    compiler._compile = slow  # type: ignore[method-assign]
    return gate


def test_a_compiling_request_waits_while_others_are_served_and_abort_leaks_nothing(
    tiny_dir,
) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_dir), dtype="float32", num_kv_blocks=64,
                                    decode_weights="dense", num_threads=1))  # fmt: skip
    gate = _blocked(engine)
    schema = {**SCHEMA, "title": "unique-1"}
    engine.add_request("g", "Hello", SamplingParams(max_tokens=8, structured=_json(schema)))
    engine.add_request("plain", "Hello", SamplingParams(max_tokens=4, temperature=0))
    done = []
    while "plain" in engine.requests:
        done += [o.request_id for o in engine.step() if o.finished]
    assert done == ["plain"] and "g" in engine.structured.parked
    assert engine.snapshot().counters["num_requests_waiting"] == 1
    outs = engine.abort_request("g")
    assert [o.finish_reason for o in outs] == ["abort"]
    gate.set()
    _no_leak(engine)
    # its grammar compiled into the cache: the same constraint is admitted at once
    engine.add_request("again", "Hello", SamplingParams(max_tokens=2, structured=_json(schema)))
    engine.structured.compiler.wait_any([next(iter(engine.structured.compiler._cache))], 30)
    while engine.requests:
        engine.step()
    _no_leak(engine)


def test_a_grammar_that_cannot_compile_refuses_its_request_and_the_engine_serves_others(
    engine,
) -> None:
    bad = StructuredOutput(kind="regex", spec="(ab", field="structured_outputs.regex")
    engine.add_request("bad", "Hello", SamplingParams(max_tokens=4, structured=bad))
    engine.add_request("good", "Hello", SamplingParams(max_tokens=4, structured=_json()))
    refusals: dict[str, str] = {}
    while engine.requests:
        engine.step()
        refusals |= engine.take_refusals()
    assert list(refusals) == ["bad"]
    assert refusals["bad"].startswith("structured_outputs.regex: invalid regex")
    # the refusal is cached: the same constraint is refused at add_request
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        engine.add_request("bad2", "Hello", SamplingParams(structured=bad))
    unsupported = _json({"type": "integer", "multipleOf": 3}, "response_format")
    with pytest.raises(ValueError, match="response_format: .*'multipleOf'"):
        engine.generate(["Hello"], SamplingParams(structured=unsupported))
    _no_leak(engine)


def test_a_compile_past_its_timeout_is_refused(tiny_dir) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_dir), dtype="float32", num_kv_blocks=64,
                                    decode_weights="dense", num_threads=1))  # fmt: skip
    gate = _blocked(engine)
    engine.add_request("slow", "Hello", SamplingParams(structured=_json({**SCHEMA, "title": "t"})))
    engine.structured.compiler.timeout = 0.0  # (admitted first: at once, it would be refused)
    engine.step()
    assert "longer than 0 s" in engine.take_refusals()["slow"]
    gate.set()
    _no_leak(engine)


def test_compile_cache_is_keyed_by_the_constraint_and_bounded(engine) -> None:
    compiler = engine.structured.compiler
    size = compiler.cache_size
    compiler.cache_size = 2
    try:
        keys = [compiler.submit("regex", f"[a-z]{{{i}}}", "f") for i in range(1, 4)]
        assert compiler.submit("regex", "[a-z]{3}", "f") == keys[2]
        compiler.wait_any(keys, 30)
        for k in keys:
            while compiler.result(k, "f") is None:
                compiler.wait_any([k], 1)
        compiler.submit("regex", "[a-z]{9}", "f")
        assert len(compiler) <= 3 and keys[0] not in compiler._cache
    finally:
        compiler.cache_size = size


def test_telemetry_reports_the_kind_and_allowed_counts(engine) -> None:
    so = StructuredOutput(kind="choice", spec='["alpha", "beta"]', field="x")
    engine.add_request("t", "Hello", SamplingParams(max_tokens=8, structured=so))
    seen = None
    while engine.requests:
        engine.step()
        snap = [r for r in engine.snapshot().requests if r.request_id == "t"]
        if snap and snap[0].allowed_tokens:
            seen = snap[0]
    assert seen is not None and seen.structured == "choice"
    assert all(1 <= n < 100 for n in seen.allowed_tokens)
    _no_leak(engine)


def test_bitwise_count_matches_unpackbits() -> None:
    words = np.array([[-1, 0, 5]], dtype=np.int32)
    want = int(np.unpackbits(words.view(np.uint8)).sum())
    assert int(np.bitwise_count(words.view(np.uint32)).sum()) == want == 34


def test_logprobs_stay_the_raw_logits_under_a_grammar(engine) -> None:
    """The first step sees the same logits with and without the constraint: its top-k list
    must be the same, although the grammar allows only two tokens."""

    def first_step(structured: StructuredOutput | None):
        engine.add_request("lp", "Hello", SamplingParams(max_tokens=1, temperature=0, logprobs=5,
                                                         structured=structured))  # fmt: skip
        while True:
            for out in engine.step():
                if out.request_id == "lp" and out.new_logprobs:
                    while engine.requests:
                        engine.step()
                    return out.new_logprobs[0]

    plain = first_step(None)
    constrained = first_step(StructuredOutput(kind="choice", spec='["yes", "no"]', field="x"))
    assert constrained.top == plain.top
    assert constrained.logprob < -0.01  # raw: the two allowed tokens do not hold all the mass
    _no_leak(engine)


def test_telemetry_counts_the_tools_a_chat_offered(engine) -> None:
    from engine_proc.engine.chat_render import ChatPrompt

    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object", "properties": {}}}} for i in range(3)]  # fmt: skip
    engine.add_request("chat", ChatPrompt([{"role": "user", "content": "hi"}], tools),
                       SamplingParams(max_tokens=2, n=2, temperature=1.0))  # fmt: skip
    engine.add_request("plain", "Hello", SamplingParams(max_tokens=2))
    seen: dict[str, int] = {}
    while engine.requests:
        engine.step()
        seen |= {r.request_id: r.num_tools for r in engine.snapshot().requests}
    assert seen == {"chat": 3, "chat#1": 3, "plain": 0}  # the fork of n=2 keeps it
    _no_leak(engine)
