"""End to end: a tiny random Llama generates the same greedy tokens with the Triton kernels
(interpreted on CPU, native on CUDA) as with the torch reference backend."""

import pytest

from engine_proc import SamplingParams
from engine_proc.attention.triton_backend import is_triton_usable
from tests.engine_fixtures import tiny_engine


@pytest.mark.slow
def test_triton_backend_generates_the_same_greedy_tokens_as_torch():
    engine_torch = tiny_engine(attention_backend="torch", block_size=16, long_prefill_chunk=9)
    device = engine_torch.device
    if not is_triton_usable(device):
        pytest.skip(f"triton cannot run on {device} here (set TRITON_INTERPRET=1 on CPU)")
    engine_triton = tiny_engine(attention_backend="triton", block_size=16, long_prefill_chunk=9)
    assert engine_triton.backend.name == "triton"
    prompts = [list(range(5, 26)), list(range(40, 47)), [3] * 18]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    ours = [o.token_ids for o in engine_triton.generate(prompts, params)]
    ref = [o.token_ids for o in engine_torch.generate(prompts, params)]
    assert ours == ref
