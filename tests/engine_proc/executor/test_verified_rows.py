"""A verified row computes what its sequence's decode step would (engine_proc/executor/
model_runner.py). Under exact activations the fused step's arithmetic depends on how many rows
decode together (precise products up to PRECISE_ROWS, fast ones past it), and a step with
drafts has more rows than the same step without them: it takes the arithmetic of its decoding
sequences' count, so greedy tokens and their logprobs stay those of plain decoding at any batch
width (a wide batch once verified its drafts with the precise products its plain steps did not
run, and its texts drifted apart)."""

from __future__ import annotations

import pytest

from engine_proc import SamplingParams
from engine_proc.executor import fused_decode as fd
from tests.engine_proc.executor.test_fused_decode import _engine, q8_head_checkpoint
from tests.engine_proc.executor.test_int8_activations import _run

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1, "disable_by_batch_size": 0}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("streams", [3, fd.PRECISE_ROWS + 3])
def test_speculation_keeps_tokens_and_logprobs_at_any_batch_width(extension, streams):
    plain = _engine("fused", q8_head_checkpoint())
    fast = _engine("fused", q8_head_checkpoint(), speculative_config=SPEC, max_num_seqs=16)
    step = fast.runner.fused.step
    assert step is not None and not step.int8_activations
    assert step.is_precise(streams) == (streams <= fd.PRECISE_ROWS)
    # three tokens allowed: the context still picks among them, so drafts are right sometimes
    alphabet = {10: 100.0, 11: 100.0, 12: 100.0}
    prompts = [[10 + j % 3, 11, 12, 10, 10 + j % 2] * 4 + [3 + j] for j in range(streams)]
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=0,
                             logit_bias=alphabet)] * streams  # fmt: skip
    # a long prompt arriving later shares some steps (more tokens than the fused step's rows)
    late = [(5 * i) % 97 + 3 for i in range(200)]
    assert len(late) > step.max_prompt_tokens
    for extra in (None, late):
        want = _run(plain, prompts, params, extra)
        got = _run(fast, prompts, params, extra)
        for i, ((tokens, logprobs), (want_tokens, want_logprobs)) in enumerate(
            zip(got, want, strict=True)
        ):
            assert tokens == want_tokens, (extra is not None, i)
            assert logprobs == want_logprobs, (extra is not None, i)  # bit for bit
    counters = fast.stats.spec_decode
    assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens
    assert fast.kv.pool.num_free == fast.num_blocks
