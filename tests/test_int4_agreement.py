"""The README's claim about 4-bit decode weights, measured: the default model with
decode_weights="int4" against transformers' dense greedy replies (tests/conftest.py's
parity_references) on the parity prompts of tests/test_hf_parity.py, all eight at once, 48 tokens,
under both bf16 arithmetics (the native_bf16 fixture).

Measured on an AVX-512 bf16 CPU, the number of leading tokens of each reply equal to the dense
reference (whose replies are 10, 8, 39, 48, 48, 11, 48 and 11 tokens long):

- native bf16 (bf16 output projection for up to 16 rows): 10, 8, 39, 48, 30, 11, 48, 11:
  7 of 8 replies identical, the other diverging after 30 tokens;
- emulated bf16 (up to 2 rows): 10, 8, 39, 48, 30, 11, 48, 5: 6 of 8 identical.

Sent one at a time instead (as the app's chat does; native bf16): 2, 8, 39, 48, 19, 11, 48, 11,
6 of 8 identical (prompts run on the dense weights, so every first token is the dense model's;
before that change, when a prompt of at most 16 tokens ran on the 4-bit copies: 2, 0, 39, 48,
30, 11, 48, 2). The test holds the batched run to what was measured, with a margin for other
CPUs' bf16 kernels: most replies identical, and none differing in its first few tokens.
"""

from __future__ import annotations

import pytest

from engine_proc import EngineConfig, LLMEngine, SamplingParams
from engine_proc.models.int4 import int4_kernels_available
from tests.test_hf_parity import PARITY_TOKENS

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not int4_kernels_available(), reason="this torch build has no int4 CPU kernels"
    ),
]

MEASURED = {  # leading tokens equal to the dense reference, per parity prompt
    True: [10, 8, 39, 48, 30, 11, 48, 11],
    False: [10, 8, 39, 48, 30, 11, 48, 5],
}


def _leading_agreement(ours: list[int], reference: list[int]) -> int:
    n = 0
    while n < min(len(ours), len(reference)) and ours[n] == reference[n]:
        n += 1
    return n


def test_int4_replies_agree_with_the_dense_model_as_measured(
    native_bf16, default_checkpoint, parity_references
) -> None:
    prompt_ids, references = parity_references
    engine = LLMEngine(
        EngineConfig(num_kv_blocks=512, decode_weights="int4"), checkpoint=default_checkpoint
    )
    assert engine.model_info()["decode_weights"] == "int4"
    outputs = engine.generate(prompt_ids, SamplingParams(max_tokens=PARITY_TOKENS, temperature=0))
    agreement = [
        _leading_agreement(o.token_ids, r) for o, r in zip(outputs, references, strict=True)
    ]
    identical = sum(o.token_ids == r for o, r in zip(outputs, references, strict=True))
    measured = MEASURED[native_bf16]
    note = f"agreement {agreement}, measured on AVX-512 bf16: {measured}"
    assert identical >= 5, note  # most replies token for token (measured: 7 and 6 of 8)
    assert min(agreement) >= 4, note  # measured: at least 5 tokens
