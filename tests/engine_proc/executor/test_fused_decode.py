"""The fused CPU decode step (engine_proc/executor/fused_decode.py,
engine_proc/native/fused_decode.cpp).

The quick tests check the option and the fallbacks without compiling anything. The slow ones
compile the extension once (into the suite's own cache dir; `extension` in tests/conftest.py)
and check greedy decoding through it against the float64 reference of the int4 arithmetic
(tests/engine_proc/models/test_int4.py), under both bf16 arithmetics: narrow steps on our kernels
are the dense model's float32 products, wide ones (and torch's kernel) bfloat16-activation products.
Its kernels one by one: tests/engine_proc/executor/test_fused_decode_kernels.py."""

from __future__ import annotations

import logging
import threading
from types import ModuleType, SimpleNamespace

import pytest
import torch

from engine_proc import EngineConfig, LLMEngine, SamplingParams
from engine_proc.config import add_kernel_arguments, kernel_options
from engine_proc.executor import fused_build, fused_head
from engine_proc.executor import fused_decode as fd
from engine_proc.models.int4 import int4_kernels_available
from engine_proc.server.wire import telemetry_from_snapshot
from tests.engine_proc.attention.test_kv_float_pools import fp16_transform
from tests.engine_proc.executor.test_fused_decode_kernels import our_kernels, q8_matrix
from tests.engine_proc.models.test_int4 import (
    _sum_of_magnitudes,
    assert_within,
    check_greedy_decoding_against_reference,
    snapped_checkpoint,
)
from tests.float64_llama import llama_forward

pytestmark = pytest.mark.skipif(
    not int4_kernels_available(), reason="this torch build has no int4 CPU kernels"
)


def _engine(decode_step: str, checkpoint=None, **config: object) -> LLMEngine:
    """An int4 engine; K/V in float32 unless ``kv_cache_dtype`` says otherwise (the default
    beside 4-bit weights is fp16), so the references compare the products exactly."""
    config.setdefault("kv_cache_dtype", "fp32")
    config.setdefault("num_kv_blocks", 64)
    return LLMEngine(
        EngineConfig(decode_weights="int4", decode_step=decode_step, **config),
        checkpoint=checkpoint or snapped_checkpoint(),
    )


def q8_head_checkpoint():
    """snapped_checkpoint() with an 8-bit valued output projection."""
    ck = snapped_checkpoint()
    ck.weights["lm_head.weight"] = q8_matrix(*ck.weights["lm_head.weight"].shape, seed=7)
    return ck


def test_decode_step_is_an_engine_option_and_a_flag():
    import argparse

    with pytest.raises(ValueError, match=r"decode_step must be one of \('eager', 'fused', 'auto'"):
        EngineConfig(decode_step="compiled")
    parser = argparse.ArgumentParser()
    add_kernel_arguments(parser)
    assert kernel_options(parser.parse_args([]))["decode_step"] == "auto"
    args = parser.parse_args(["--decode-step", "eager"])
    assert kernel_options(args)["decode_step"] == "eager"


def _nothing_built():
    pytest.fail("nothing should be built")


def test_eager_is_the_api_default_and_builds_nothing(monkeypatch):
    monkeypatch.setattr(fused_build, "load_extension", _nothing_built)
    engine = _engine("eager")
    assert EngineConfig().decode_step == "eager"
    assert engine.runner.fused.state == "eager"


def test_models_it_cannot_serve_decode_eagerly_with_the_reason_logged(monkeypatch, caplog):
    monkeypatch.setattr(fused_build, "load_extension", _nothing_built)
    caplog.set_level(logging.WARNING, logger="engine_proc.executor.fused_lifecycle")
    dense = LLMEngine(EngineConfig(num_kv_blocks=64, decode_step="fused"),
                      checkpoint=snapped_checkpoint())  # fmt: skip
    assert dense.runner.fused.state == "eager"
    assert "needs decode_weights='int4'" in caplog.text
    caplog.clear()
    int8 = _engine("fused", kv_cache_dtype="int8")
    assert int8.runner.fused.state == "eager"
    assert "needs a float32 model and a float32 or fp16 KV cache" in caplog.text


def test_a_failed_build_falls_back_to_eager_with_a_warning(monkeypatch, caplog):
    def no_compiler():
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(fused_build, "load_extension", no_compiler)
    caplog.set_level(logging.WARNING, logger="engine_proc.executor.fused_lifecycle")
    engine = _engine("fused")
    assert engine.runner.fused.state == "eager"
    assert engine.runner.fused.detail == "the build failed: no C++ compiler"  # the window's
    assert "no C++ compiler" in caplog.text and "decoding eagerly" in caplog.text
    [out] = engine.generate([list(range(5, 12))], fd_params())
    assert len(out.token_ids) == 4 and engine.runner.num_fused_steps == 0


def fd_params():
    from engine_proc import SamplingParams

    return SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


# ---- compiled (slow: the first build takes about a minute on 2 cores) ----------------------


def _products(step: fd.FusedDecodeStep, rows: int) -> str:
    """What a fused step of ``rows`` rows computes (tests/engine_proc/models/test_int4.py:
    DECODE_PRODUCTS)."""
    if step.int4_kernel == "torch":
        return "bf16"
    if rows <= step.precise_rows:
        return "exact"
    if step.int4_kernel == "avx2_fp32":  # float32 products, the MLP's on 8-bit activations
        return "q8_mlp" if step.q8_products else "exact"
    return "q8" if step.q8_products else "bf16_in"  # AVX512-BF16


@pytest.mark.slow
def test_fused_greedy_decoding_follows_the_float64_reference(extension, native_bf16):
    engine = _engine("fused")
    assert engine.runner.fused.state == "fused"
    step = engine.runner.fused.step
    check_greedy_decoding_against_reference(engine, native_bf16, decode_products=_products(step, 3))
    # every decode step (8 - 1 per batch) ran fused; the prefills ran eagerly
    assert engine.runner.num_fused_steps == 2 * 7


@pytest.mark.slow
@pytest.mark.parametrize("wide", [False, True], ids=["precise", "wide"])
@pytest.mark.parametrize("chunks", [0, 3])
def test_fused_steps_over_an_fp16_pool_follow_the_float64_forward_of_float16_kv(
    extension, wide, chunks
):
    """The int4 default beside a float32 model on AVX512-BF16 CPUs (any CPU when asked for):
    K/V stored as float16 (rotary keys and values
    rounded to nearest, as torch's .half()), read back widened, by the fused step's prompt rows
    and decodes, narrow and wide, attended whole or in chunks merged; eager steps (prefill
    where the kernel takes no rows) read the same pool through torch. The exact 8-bit head
    (every row's logits float32 products) leaves precise steps a tolerance of 2^-11, which K/V
    1% off fail."""
    ck = q8_head_checkpoint()
    engine = _engine("fused", checkpoint=ck, kv_cache_dtype="fp16")
    assert engine.runner.kv_cache.dtype == torch.float16
    step = fd.FusedDecodeStep.create(engine.model, extension, attention_chunks=chunks)
    engine.runner.fused.step = step
    if wide:
        step.precise_rows = 0
    check_greedy_decoding_against_reference(
        engine, engine.model.native_bf16, ck, 0,
        decode_products=_products(step, 1 if wide else 3), kv_transform=fp16_transform,
    )  # fmt: skip
    assert engine.runner.num_fused_steps == 2 * 7


@pytest.mark.slow
@pytest.mark.parametrize("q8_activations", [True, False])
def test_wide_fused_steps_take_fast_products(extension, q8_activations):
    """Steps wider than precise_rows (set to 0 here: every step) run our kernels' fast
    products: bfloat16 activations, float32 outputs (AVX512-BF16); float32 products on AVX2;
    on both the MLP's on 8-bit activations (unless turned off)."""
    engine = _engine("fused")
    step = fd.FusedDecodeStep.create(engine.model, extension, q8_activations=q8_activations)
    engine.runner.fused.step = step
    q8_kernel = fd.Q8_KERNELS[extension.best_q8_kernel()]
    q8_products = fd.Q8_PRODUCTS.get((step.int4_kernel, q8_kernel), ())
    assert step.q8_products == (q8_products if q8_activations else ())
    step.precise_rows = 0
    native = engine.model.native_bf16
    check_greedy_decoding_against_reference(engine, native, decode_products=_products(step, 1))
    assert engine.runner.num_fused_steps == 2 * 7


@pytest.mark.slow
@pytest.mark.parametrize("chunks", [2, 5])
def test_attention_split_into_chunks_decodes_like_the_reference(extension, chunks):
    """Long contexts are attended in chunks of blocks on several threads and merged: forced here
    on short ones (5 chunks: more than some sequences have blocks, so some chunks are empty)."""
    engine = _engine("fused")
    step = fd.FusedDecodeStep.create(engine.model, extension, attention_chunks=chunks)
    engine.runner.fused.step = step
    native = engine.model.native_bf16
    check_greedy_decoding_against_reference(engine, native, decode_products=_products(step, 3))
    assert engine.runner.num_fused_steps == 2 * 7


@pytest.mark.slow
def test_a_step_wider_than_one_call_runs_as_several(extension, monkeypatch):
    """Rows are independent: a 3-row decode step as calls of 2 + 1 rows decodes like the
    reference (each call writes its rows' K/V and reads only their own blocks)."""
    monkeypatch.setattr(fd, "ROWS_PER_CALL", 2)
    engine = _engine("fused")
    step = engine.runner.fused.step
    assert step is not None
    calls: list[int] = []

    class CountingDecoder:
        def forward(self, input_ids, *args):
            calls.append(len(input_ids))
            return decoder.forward(input_ids, *args)

    decoder, step.decoder = step.decoder, CountingDecoder()
    native = engine.model.native_bf16
    check_greedy_decoding_against_reference(engine, native, decode_products=_products(step, 3))
    assert engine.runner.num_fused_steps == 2 * 7
    assert sorted(set(calls)) == [1, 2] and max(calls) == 2


@pytest.mark.slow
@pytest.mark.parametrize("kernel", fd.INT4_KERNELS)
def test_every_int4_kernel_decodes_like_the_reference(extension, kernel):
    if kernel not in ("torch", *our_kernels(extension)):  # not compiled in: that CPU lacks it
        kernel = "torch"
    engine = _engine("fused")
    step = fd.FusedDecodeStep.create(engine.model, extension, kernel)
    engine.runner.fused.step = step
    native = engine.model.native_bf16
    check_greedy_decoding_against_reference(engine, native, decode_products=_products(step, 3))
    assert engine.runner.num_fused_steps == 2 * 7


def test_a_start_finding_a_build_in_progress_decodes_eagerly_then_switches(monkeypatch):
    """Another process is building the fused step (its lock held): this engine decodes
    eagerly, says so in its telemetry, and switches once that build is ready (a fake build and
    a fake step here: the real ones in the slow test below)."""
    finished = threading.Event()
    module = ModuleType("the_extension")

    def another_process_building() -> ModuleType:
        assert finished.wait(timeout=60)  # load_extension waits on the build lock meanwhile
        return module

    monkeypatch.setattr(fused_build, "build_unavailable_reason", lambda: None)
    monkeypatch.setattr(fused_build, "build_state", lambda: "building")
    monkeypatch.setattr(fused_build, "load_extension", another_process_building)
    step = SimpleNamespace(int4_kernel="avx2_fp32", int8_activations=False)
    monkeypatch.setattr(fd.FusedDecodeStep, "create", lambda model, module, activations: step)
    monkeypatch.setattr(fused_head, "use_head_kernel", lambda model, module, step: None)
    engine = _engine("auto")
    fused = engine.runner.fused
    assert fused.ready() is None and (fused.state, fused.detail) == ("building", "elsewhere")
    snap = engine.snapshot()
    assert (snap.decode_step, snap.decode_detail) == ("building", "elsewhere")
    finished.set()
    assert fused._pending is not None and fused._pending.result(timeout=60) is module
    assert fused.ready() is step and (fused.state, fused.detail) == ("fused", "avx2_fp32")
    telemetry = telemetry_from_snapshot(engine.snapshot(), seq=1, paused=False, num_clients=0)
    assert (telemetry.decode_step, telemetry.decode_detail) == ("fused", "avx2_fp32")


def test_eager_says_why(monkeypatch):
    monkeypatch.setattr(fused_build, "load_extension", _nothing_built)
    assert _engine("eager").runner.fused.detail == "decode_step='eager'"
    dense = LLMEngine(EngineConfig(num_kv_blocks=64, decode_step="auto"),
                      checkpoint=snapped_checkpoint())  # fmt: skip
    assert (dense.snapshot().decode_step, dense.snapshot().decode_detail) == (
        "eager", "needs decode_weights='int4'")


@pytest.mark.slow
def test_auto_loads_a_cached_build_or_builds_in_the_background(extension, monkeypatch):
    assert fused_build.is_built()  # the fixture's build, in this suite's cache dir
    assert _engine("auto").runner.fused.state == "fused"
    monkeypatch.setattr(fused_build, "build_state", lambda: "absent")  # as on a first start
    engine = _engine("auto")
    assert (engine.runner.fused.state, engine.runner.fused.detail) == ("building", "here")
    pending = engine.runner.fused._pending
    assert pending is not None
    pending.result(timeout=600)  # the background thread finds the module already loaded
    [out] = engine.generate([list(range(5, 12))], fd_params())
    assert engine.runner.fused.state == "fused" and len(out.token_ids) == 4
    assert engine.runner.num_fused_steps == 3


@pytest.mark.slow
@pytest.mark.parametrize(
    ("prompt_rows", "kernel"), [(False, None), (True, "avx512_bf16"), (True, "avx2_fp32")]
)
def test_mixed_steps_run_their_decodes_fused_and_their_prompts_eagerly_or_as_rows(
    extension, prompt_rows, kernel
):
    """A step that prefills a prompt while four sequences decode runs as a fused pass over the
    four one-token rows and a pass over the prompt: eager (split from 4 rows here, from the
    fused step's wide steps by default), or as one-token rows of the fused step's precise
    products where it takes prompts (every prompt here, the first step's included). All exact
    here (up to precise_rows rows, the 8-bit head in float32), so every logit row of every
    sequence is the float64 reference's (tests/float64_llama.py) to float32 rounding,
    whichever pass computed it."""
    ck = q8_head_checkpoint()
    engine = _engine("fused", checkpoint=ck)
    if kernel is not None:  # prompts as rows: each of our kernels that takes them
        if kernel not in our_kernels(extension):
            pytest.skip(f"the {kernel} kernel is not compiled in")
        try:
            engine.runner.fused.step = fd.FusedDecodeStep.create(engine.model, extension, kernel)
        except ValueError as exc:  # it cannot read torch's packed layout here
            pytest.skip(str(exc))
    step = engine.runner.fused.step
    assert step is not None and fused_head.use_head_kernel(engine.model, extension, step) == "q8"
    engine.runner.min_split_rows = 4
    if _products(step, 4) != "exact":
        pytest.skip("torch's 4-bit kernel (bfloat16 products) runs here, not ours")
    if prompt_rows and step.max_prompt_tokens == 0:
        pytest.skip(f"the {step.int4_kernel} kernel's fused step takes no prompts")
    if not prompt_rows:
        step.max_prompt_tokens = 0
    rows: dict[str, list[torch.Tensor]] = {}
    execute = engine.runner.execute

    def recording(batch):
        logits, seqs = execute(batch)
        for row, seq in zip(logits, seqs, strict=True):
            rows.setdefault(seq.request_id, []).append(row.double())
        return logits, seqs

    engine.runner.execute = recording
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = {"a": list(range(5, 14)), "b": list(range(20, 27)), "c": [3] * 11, "d": [9, 8, 7]}
    prompts |= {"late": list(range(50, 70))}
    outputs: dict[str, list[int]] = {}
    for rid in "abcd":
        engine.add_request(rid, prompts[rid], params)
    for n in range(40):
        if n == 2:  # the four decode; the late prompt arrives: a mixed step
            engine.add_request("late", prompts["late"], params)
        for out in engine.step():
            outputs[out.request_id] = out.token_ids
        if not engine.has_unfinished_requests():
            break
    if prompt_rows:  # the four prompts together, then the late one
        assert engine.runner.num_fused_prompt_steps == 2 and engine.runner.num_split_steps == 0
    else:
        assert engine.runner.num_fused_prompt_steps == 0 and engine.runner.num_split_steps == 1
    for rid, prompt in prompts.items():
        out = outputs[rid]
        assert len(out) == params.max_tokens
        ref = llama_forward(ck.config, ck.weights, prompt + out[:-1])
        expected = ref.logits[len(prompt) - 1 :]
        tol = 2**-14 * _sum_of_magnitudes(ref.hidden[len(prompt) - 1 :], ref.lm_head)
        assert_within(torch.stack(rows[rid]), expected, tol + 2**-24 * expected.abs())
        for i, token in enumerate(out):
            assert expected[i, token] + tol[i, token] >= (expected[i] - tol[i]).max(), (rid, i)
    assert engine.kv.pool.num_free == engine.num_blocks


@pytest.mark.slow
@pytest.mark.parametrize("attention", [None, "avx2"])  # the best that fits; AVX2's, forced
def test_a_row_computes_the_same_bits_beside_any_other_rows(extension, attention):
    """Attention splits a long context's keys among threads and merges the parts; whether it
    splits a row follows from that row's context alone, so the row's logits are bit for bit
    what they would be alone: how a speculative step's verification rows give plain decoding's
    tokens (greedy texts once differed on AVX-512 under 8-bit activations), and a chat beside
    others its tokens alone. Three 750-token contexts together are past the split threshold
    (2^17 key elements), each alone is not. Prompts are cached first, so their last block runs
    as fused rows alike in both runs."""
    from tests.engine_proc.executor.test_int8_activations import _run

    if attention == "avx2" and not extension.has_avx2():
        pytest.skip("not an AVX2 build")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the split needs two threads (suite workers run one)
    try:
        engine = _engine("fused", num_kv_blocks=400)
        if attention is not None:
            step = fd.FusedDecodeStep.create(engine.model, extension, attention_kernel=attention)
            fused_head.use_head_kernel(engine.model, extension, step)
            engine.runner.fused.step = step
        prompts = [[(7 * i + 13 * j) % 120 + 3 for i in range(750)] for j in range(3)]
        params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)]
        for p in prompts:  # warm the prefix cache
            _run(engine, [p], params)
        alone = [_run(engine, [p], params)[0] for p in prompts]
        together = _run(engine, prompts, params * 3)
    finally:
        torch.set_num_threads(threads)
    assert engine.runner.num_fused_steps > 0
    assert together == alone  # tokens and logprobs, exactly
    assert engine.kv.pool.num_free == engine.num_blocks
