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
from engine_proc.executor import fused_decode as fd
from tests.engine_proc.executor.test_fused_decode import _engine, q8_head_checkpoint
from tests.engine_proc.models.test_int4 import (
    check_greedy_decoding_against_reference,
    snapped_checkpoint,
)
from ui.window.decode_status import decode_status_text


def test_an_engine_option_and_a_flag_that_name_the_allowed_values():
    with pytest.raises(ValueError, match=r"decode_activations must be one of \('exact', 'int8', "
                                         r"'auto'\), got 'fp8'"):  # fmt: skip
        EngineConfig(decode_activations="fp8")
    assert EngineConfig().decode_activations == "exact"
    parser = argparse.ArgumentParser()
    add_kernel_arguments(parser)
    assert kernel_options(parser.parse_args([]))["decode_activations"] == "exact"
    args = parser.parse_args(["--decode-activations", "int8"])
    assert kernel_options(args)["decode_activations"] == "int8"
    args = parser.parse_args(["--decode-activations", "auto"])
    assert kernel_options(args)["decode_activations"] == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--decode-activations", "q4"])


def test_the_status_bar_names_the_arithmetic():
    assert decode_status_text("fused", "avx2_fp32") == "decode: fused (AVX2 int4)"
    assert (decode_status_text("fused", "avx2_fp32+int8")
            == "decode: fused (AVX2 int4 x 8-bit activations)")  # fmt: skip


def _int8_engine(checkpoint=None, **config):
    checkpoint = checkpoint or q8_head_checkpoint()
    engine = _engine("fused", checkpoint=checkpoint, decode_activations="int8", **config)
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


def _run(engine, prompts, params, late: list[int] | None = None):
    """Each request's tokens and their logprobs (the raw logits' log-softmax); ``late``: a long
    prompt that arrives after two steps, so later steps mix its chunks with the others' rows."""
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), prompt, p)
    got: dict[str, tuple[list[int], list[float]]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        if late is not None and steps == 2:
            engine.add_request("late", late, SamplingParams(max_tokens=4, ignore_eos=True))
        steps += 1
        for out in engine.step():
            tokens, logprobs = got.setdefault(out.request_id, ([], []))
            tokens[:] = out.token_ids
            logprobs += [lp.logprob for lp in out.new_logprobs or []]
    return [got[str(i)] for i in range(len(prompts))]


@pytest.mark.slow
@pytest.mark.parametrize("head", ["q8", "bf16"])
def test_speculative_decoding_keeps_the_tokens_and_logits(extension, head):
    """N-gram drafts verified as rows of the fused step: the same 8-bit arithmetic as a decode
    row, so the tokens equal the engine's without speculation and so do their logprobs (which
    the exact products would move by about a tenth), drafts accepted and rejected; also while
    a long prompt's chunks (more than the fused step takes as rows) share the steps, and with
    an output projection that is not 8-bit (its bf16 copy, every row by one kernel)."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
            "prompt_lookup_min": 1, "disable_by_batch_size": 0}  # fmt: skip
    ck = q8_head_checkpoint if head == "q8" else snapped_checkpoint
    plain, fast = _int8_engine(ck()), _int8_engine(ck(), speculative_config=spec)
    assert fast.runner.fused.step.wide_head_kind == head
    # three tokens allowed: the context still picks among them, so drafts are right sometimes
    alphabet = {10: 100.0, 11: 100.0, 12: 100.0}
    prompts = [[10, 11, 12, 10, 10] * 4, list(range(30, 50)) + [10, 11, 12, 11] * 3, [7, 8, 9] * 6]
    kw = {"max_tokens": 30, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    params = [SamplingParams(logit_bias=alphabet, **kw), SamplingParams(logit_bias=alphabet, **kw),
              SamplingParams(**kw)]  # fmt: skip
    late = [(5 * i) % 97 + 3 for i in range(200)]
    assert len(late) > fast.runner.fused.step.max_prompt_tokens
    prompt_rows = fast.runner.num_fused_prompt_steps
    for together in (True, False):
        if together:
            want = _run(plain, prompts, params, late)
            got = _run(fast, prompts, params, late)
        else:
            want = [_run(plain, [p], [s])[0] for p, s in zip(prompts, params, strict=True)]
            got = [_run(fast, [p], [s])[0] for p, s in zip(prompts, params, strict=True)]
        for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want, strict=True):
            assert tokens == want_tokens and len(logprobs) == len(tokens) == 30
            assert logprobs == pytest.approx(want_logprobs, abs=1e-4)
    counters = fast.stats.spec_decode
    assert counters.num_accepted_tokens > 0
    assert counters.num_accepted_tokens < counters.num_draft_tokens  # some were rejected
    # verification passes ran as fused rows: more of them than the plain engine's prompt rows
    assert fast.runner.num_fused_prompt_steps - prompt_rows > plain.runner.num_fused_prompt_steps
    assert fast.kv.pool.num_free == fast.num_blocks


@pytest.mark.slow
def test_our_kernels_only(extension, caplog):
    """Where torch's 4-bit kernel runs (our kernels cannot read the model), the step keeps
    float32 activations and says so."""
    engine = _int8_engine()
    step = fd.FusedDecodeStep.create(engine.model, extension, "torch", activations="int8")
    assert not step.int8_activations and step.precise_rows == fd.PRECISE_ROWS
    assert "decode_activations='int8' needs our 4-bit kernels" in caplog.text


def test_which_kernels_take_8bit_activations():
    """"int8" wherever our 4-bit kernels meet a vector 8-bit kernel; "auto" where it was
    measured: the AVX2 4-bit kernel, and the AVX512-BF16 one with the VNNI 8-bit kernel; never
    with torch's kernel or the portable 8-bit one."""
    take = fd.takes_int8_activations
    for q8 in ("avx2", "avx512_vnni"):
        assert take("int8", "avx2_fp32", q8) and take("int8", "avx512_bf16", q8)
        assert take("auto", "avx2_fp32", q8)
        assert take("auto", "avx512_bf16", q8) == (q8 == "avx512_vnni")
        assert not take("int8", "torch", q8) and not take("auto", "torch", q8)
        assert not take("exact", "avx2_fp32", q8) and not take("exact", "avx512_bf16", q8)
    assert not take("int8", "avx2_fp32", "portable") and not take("auto", "avx2_fp32", "portable")


@pytest.mark.slow
def test_auto_is_int8_on_our_kernels_and_exact_elsewhere_without_a_word(extension, caplog):
    """"auto" (the apps' default): the engine runs what takes_int8_activations picks for its
    kernel, token for token and logprob for logprob the engine told that arithmetic; our AVX2
    kernel takes 8 bits, torch's kernel and an eager engine keep float32 activations, silently."""
    caplog.clear()
    auto = _engine("fused", checkpoint=q8_head_checkpoint(), decode_activations="auto")
    step = auto.runner.fused.step
    assert step is not None
    int8 = fd.takes_int8_activations("auto", step.int4_kernel, step.q8_kernel)
    assert step.int8_activations == int8 and auto.runner.fused.detail.endswith("+int8") == int8
    same = _engine("fused", checkpoint=q8_head_checkpoint(),
                   decode_activations="int8" if int8 else "exact")  # fmt: skip
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)] * 2
    prompts = [[1, 5, 9, 14], [2, 7]]
    got, want = _run(auto, prompts, params), _run(same, prompts, params)
    for (tokens, logprobs), (tokens_want, logprobs_want) in zip(got, want, strict=True):
        assert tokens == tokens_want and len(logprobs) == 12
        assert logprobs == pytest.approx(logprobs_want, abs=1e-6)
    if extension.best_q8_kernel() != 0:  # a vector 8-bit kernel: the AVX2 4-bit kernel takes it
        avx2 = fd.FusedDecodeStep.create(auto.model, extension, "avx2_fp32", activations="auto")
        assert avx2.int8_activations and avx2.precise_rows == 0
    vnni = fd.Q8_KERNELS[extension.best_q8_kernel()] == "avx512_vnni"
    if vnni and extension.has_avx512_bf16() and fd.torch_int4_pack_block() == 64:
        bf16 = fd.FusedDecodeStep.create(auto.model, extension, "avx512_bf16", activations="auto")
        assert bf16.int8_activations and bf16.precise_rows == 0
    torch_step = fd.FusedDecodeStep.create(auto.model, extension, "torch", activations="auto")
    assert not torch_step.int8_activations and torch_step.precise_rows == fd.PRECISE_ROWS
    eager = _engine("eager", decode_activations="auto")
    assert eager.runner.fused.state == "eager"
    assert "decode_activations" not in caplog.text


def test_without_the_fused_step_the_log_says_int8_does_nothing(caplog):
    engine = _engine("eager", decode_activations="int8")
    assert engine.runner.fused.state == "eager"
    assert "decode_activations='int8' is the fused CPU decode step's" in caplog.text
    assert "decode_step='eager'" in caplog.text
