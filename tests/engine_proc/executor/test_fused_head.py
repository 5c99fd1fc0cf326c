"""The fused step's output projection (engine_proc/executor/fused_head.py): which head kernel
computes narrow and wide steps' logits, and greedy decoding through the exact 8-bit head against the
float64 reference. Its kernels one by one: tests/engine_proc/executor/test_head_q8_kernels.py."""

from __future__ import annotations

import pytest
import torch

from engine_proc.executor import fused_decode as fd
from engine_proc.executor import fused_head
from engine_proc.models.int4 import int4_kernels_available
from tests.engine_proc.executor.test_fused_decode import (
    _engine,
    _products,
    fd_params,
    q8_head_checkpoint,
)
from tests.engine_proc.models.test_int4 import check_greedy_decoding_against_reference

pytestmark = pytest.mark.skipif(
    not int4_kernels_available(), reason="this torch build has no int4 CPU kernels"
)


@pytest.mark.slow
def test_fused_decoding_with_an_8bit_head_follows_the_float64_reference(extension):
    ck = q8_head_checkpoint()
    engine = _engine("fused", checkpoint=ck)
    assert fused_head.use_head_kernel(engine.model, extension) == "q8"
    assert fused_head.use_head_kernel(_engine("fused").model, extension) == "bf16"
    # float32 products on the exact weights: the reference's unrounded head, for every row;
    # with our kernels, float32 products everywhere (a tolerance of 2^-14)
    step = engine.runner.fused.step
    check_greedy_decoding_against_reference(
        engine, engine.model.native_bf16, ck, 0, decode_products=_products(step, 3)
    )


@pytest.mark.slow
def test_only_wide_fused_steps_take_their_logits_from_the_wide_head(extension):
    engine = _engine("fused", checkpoint=q8_head_checkpoint())
    step = engine.runner.fused.step
    if step.wide_head is None:
        pytest.skip("the wide 8-bit heads need AVX512-BF16 or AVX512-VNNI")
    # by CPU: AVX512-VNNI with AVX512-BF16 (wide steps' four products on 8 bits): 8-bit
    # activations; AVX512-BF16 alone: bfloat16 ones
    vnni = extension.q8_kernel_compiled(fd.Q8_KERNELS.index("avx512_vnni"))
    expected_kind = "q8" if vnni and step.int4_kernel == "avx512_bf16" else "bf16"
    assert step.wide_head_kind == expected_kind
    codes, scales = extension.q8_pack(engine.model.lm_head)
    hidden = torch.randn(9, engine.model.config.hidden_size)
    if expected_kind == "q8":
        offset = extension.q8_vnni_pack(codes)
        expected = extension.q8_q8_logits(hidden, offset, scales, True)
    else:
        expected = extension.q8_bf16_logits(hidden, codes, scales)
    assert torch.equal(step.wide_head(hidden), expected)
    calls: list[int] = []
    wide_head = step.wide_head

    def counting(hidden):
        calls.append(hidden.shape[0])
        return wide_head(hidden)

    step.wide_head = counting
    prompts = [list(range(5, 12)), list(range(20, 31)), [3] * 9]
    engine.generate(prompts, fd_params())  # 3 rows a step: precise, the exact head
    assert calls == []
    step.precise_rows = 2
    engine.generate(prompts, fd_params())  # every decode step is wide now
    assert calls == [3, 3, 3]  # fd_params: 4 tokens, the first from the (eager) prefill
