"""decode_activations="int8" (EngineConfig; engine_proc/executor/fused_decode.py): every fused
step, a single chat's included, takes 8-bit activations in its four 4-bit products and the 8-bit
output projection (llama.cpp's Q4 x Q8 arithmetic). Checked against the float64 reference of that
arithmetic (tests/float64_llama.py, activations rounded per group of 32 by its own code), and
speculative decoding stays exact under it: a verified row's logits are its decode step's."""

from __future__ import annotations

import argparse

import pytest

from engine_proc import EngineConfig, SamplingParams
from engine_proc.config import add_kernel_arguments, kernel_options
from tests.engine_proc.executor.test_fused_decode import _engine, q8_head_checkpoint
from tests.engine_proc.models.test_int4 import check_greedy_decoding_against_reference
from ui.window.decode_status import decode_status_text


def test_an_engine_option_and_a_flag_that_name_the_allowed_values():
    with pytest.raises(ValueError, match=r"decode_activations must be one of \('exact', 'int8'\), "
                                         r"got 'fp8'"):  # fmt: skip
        EngineConfig(decode_activations="fp8")
    assert EngineConfig().decode_activations == "exact"
    parser = argparse.ArgumentParser()
    add_kernel_arguments(parser)
    assert kernel_options(parser.parse_args([]))["decode_activations"] == "exact"
    args = parser.parse_args(["--decode-activations", "int8"])
    assert kernel_options(args)["decode_activations"] == "int8"
    with pytest.raises(SystemExit):
        parser.parse_args(["--decode-activations", "q4"])


def test_the_status_bar_names_the_arithmetic():
    assert decode_status_text("fused", "avx2_fp32") == "decode: fused (AVX2 int4)"
    assert (decode_status_text("fused", "avx2_fp32+int8")
            == "decode: fused (AVX2 int4 x 8-bit activations)")  # fmt: skip


def _int8_engine(**config):
    engine = _engine("fused", checkpoint=q8_head_checkpoint(), decode_activations="int8", **config)
    step = engine.runner.fused.step
    assert step is not None
    if not step.int8_activations:
        pytest.skip("8-bit activations need our 4-bit kernels and an AVX2 or VNNI 8-bit kernel")
    return engine


@pytest.mark.slow
def test_every_step_follows_the_float64_reference_of_8bit_activations(extension):
    engine = _int8_engine()
    step = engine.runner.fused.step
    assert step.precise_rows == 0 and set(step.q8_products) == {"qkv", "o", "gate_up", "down"}
    assert step.wide_head_kind == "q8" and engine.runner.fused.detail.endswith("+int8")
    # three rows a step, then one: both through the 8-bit products and head
    check_greedy_decoding_against_reference(
        engine, engine.model.native_bf16, q8_head_checkpoint(), 0, decode_products="q8_all"
    )
    assert engine.runner.num_fused_steps == 2 * 7


def _run(engine, prompts, params) -> list[tuple[list[int], list[float]]]:
    """Each request's tokens and their logprobs (the raw logits' log-softmax)."""
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), prompt, p)
    got: dict[str, tuple[list[int], list[float]]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens, logprobs = got.setdefault(out.request_id, ([], []))
            tokens[:] = out.token_ids
            logprobs += [lp.logprob for lp in out.new_logprobs or []]
    return [got[str(i)] for i in range(len(prompts))]


@pytest.mark.slow
def test_speculative_decoding_keeps_the_tokens_and_logits(extension):
    """N-gram drafts verified as rows of the fused step: the same 8-bit arithmetic as a decode
    row, so the tokens equal the engine's without speculation and so do their logprobs (which
    the exact products would move by about a tenth), drafts accepted and rejected."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
            "prompt_lookup_min": 1, "disable_by_batch_size": 0}  # fmt: skip
    plain, fast = _int8_engine(), _int8_engine(speculative_config=spec)
    # three tokens allowed: the context still picks among them, so drafts are right sometimes
    alphabet = {10: 100.0, 11: 100.0, 12: 100.0}
    prompts = [[10, 11, 12, 10, 10] * 4, list(range(30, 50)) + [10, 11, 12, 11] * 3, [7, 8, 9] * 6]
    kw = {"max_tokens": 30, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    params = [SamplingParams(logit_bias=alphabet, **kw), SamplingParams(logit_bias=alphabet, **kw),
              SamplingParams(**kw)]  # fmt: skip
    for together in (True, False):
        if together:
            want, got = _run(plain, prompts, params), _run(fast, prompts, params)
        else:
            want = [_run(plain, [p], [s])[0] for p, s in zip(prompts, params, strict=True)]
            got = [_run(fast, [p], [s])[0] for p, s in zip(prompts, params, strict=True)]
        for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want, strict=True):
            assert tokens == want_tokens and len(logprobs) == len(tokens) == 30
            assert logprobs == pytest.approx(want_logprobs, abs=1e-4)
    counters = fast.stats.spec_decode
    assert counters.num_accepted_tokens > 0
    assert counters.num_accepted_tokens < counters.num_draft_tokens  # some were rejected
    assert fast.runner.num_fused_prompt_steps > 0  # the verified rows ran fused
    assert fast.kv.pool.num_free == fast.num_blocks
