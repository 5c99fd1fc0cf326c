"""4-bit decode weights (engine_proc/models/int4.py): the kernel against brute-force
dequantized matrices, exact recovery of Q4_1-style weights, and the model's routing (prompt
products dense, decode products 4-bit) against the dense model."""

import pytest
import torch

from engine_proc import EngineConfig, LLMEngine, SamplingParams
from engine_proc.attention.base import AttentionMetadata
from engine_proc.models.int4 import (
    GROUP_SIZE,
    MAX_ROWS,
    int4_kernels_available,
    int4_matmul,
    quantize_int4,
)
from tests.engine_fixtures import tiny_checkpoint, tiny_engine

pytestmark = pytest.mark.skipif(
    not int4_kernels_available(), reason="this torch build has no int4 CPU kernels"
)


def q4_1_matrix(out_features: int, in_features: int, seed: int = 0):
    """A matrix of exactly 16 levels per group of 32, (code - 8) * scale + zero, with each
    group's extreme codes 0 and 15 present (what a GGUF Q4_1 tensor dequantizes to)."""
    gen = torch.Generator().manual_seed(seed)
    groups = in_features // GROUP_SIZE
    codes = torch.randint(0, 16, (out_features, groups, GROUP_SIZE), generator=gen)
    codes[:, :, 0], codes[:, :, 1] = 0, 15
    scale = (torch.rand(out_features, groups, generator=gen) * 0.02 + 0.005).bfloat16().float()
    zero = (torch.randn(out_features, groups, generator=gen) * 0.05).bfloat16().float()
    weight = (codes - 8).float() * scale[..., None] + zero[..., None]
    return weight.view(out_features, in_features), codes


def test_q4_1_weights_are_recovered_exactly():
    weight, _ = q4_1_matrix(48, 96)
    packed = quantize_int4(weight)
    # One-hot rows read single weights back; bf16 outputs hold them to 2^-9 relative.
    eye = torch.eye(96)
    seen = int4_matmul(eye, packed).t()
    torch.testing.assert_close(seen, weight, rtol=2**-8, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS])
def test_matmul_error_is_within_the_quantization_bound(rows):
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(64, 128, generator=gen)
    x = torch.randn(rows, 128, generator=gen)
    got = int4_matmul(x, quantize_int4(weight))
    exact = x @ weight.t()
    groups = weight.view(64, -1, GROUP_SIZE)
    step = ((groups.amax(-1) - groups.amin(-1)) / 15).max()
    # Each weight is off by at most half a step (+ bf16 rounding of inputs and outputs).
    bound = x.abs().sum(dim=1, keepdim=True) * (step / 2 + 2**-8 * weight.abs().max())
    bound = bound + 2**-7 * exact.abs()
    assert ((got - exact).abs() <= bound).all()
    assert got.dtype == x.dtype


def test_linear_uses_int4_up_to_max_rows_then_dense_and_adds_the_bias():
    from engine_proc.models.llama import Linear

    weight, _ = q4_1_matrix(64, 96, seed=3)
    bias = torch.randn(64)
    packed = quantize_int4(weight)
    linear = Linear(torch.device("cpu"), torch.float32)
    for rows in (1, MAX_ROWS, MAX_ROWS + 1):
        x = torch.randn(rows, 96)
        got = linear(x, weight, bias, packed)
        exact = x @ weight.t() + bias
        if rows <= MAX_ROWS:  # 4-bit path: bf16 activations, lossless weights
            assert not torch.equal(got, torch.nn.functional.linear(x, weight, bias))
            torch.testing.assert_close(got, exact, rtol=2e-2, atol=2e-2)
        else:  # dense path, bit for bit
            assert torch.equal(got, torch.nn.functional.linear(x, weight, bias))
    x = torch.randn(96, 4).t()  # a non-contiguous view (a slice of a fused output)
    got = linear(x, weight, None, packed)
    torch.testing.assert_close(got, x @ weight.t(), rtol=2e-2, atol=2e-2)


def test_rejects_shapes_it_cannot_pack():
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize_int4(torch.randn(8, 48))
    with pytest.raises(ValueError, match="2-D"):
        quantize_int4(torch.randn(8))


def test_engine_config_rejects_unknown_decode_weights():
    with pytest.raises(ValueError, match=r"one of \('dense', 'int4', 'auto'\), got 'int3'"):
        tiny_engine(decode_weights="int3")


def snapped_checkpoint():
    """The tiny model with every linear weight replaced by a matrix built from random 4-bit
    codes, bf16 scales and offsets (what a GGUF Q4_1 file dequantizes to, built independently of
    the quantizer). 4-bit copies of these weights are lossless, so the int4 engine may differ
    from the dense one only by its bf16 activations."""
    ck = tiny_checkpoint()
    for i, (name, w) in enumerate(sorted(ck.weights.items())):
        if w.dim() == 2 and "embed" not in name and "lm_head" not in name:
            ck.weights[name], _ = q4_1_matrix(*w.shape, seed=i)
    return ck


def _engine(decode_weights: str):
    return LLMEngine(
        EngineConfig(num_kv_blocks=64, decode_weights=decode_weights),
        checkpoint=snapped_checkpoint(),
    )


def _logits(engine, ids):
    n = len(ids)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.arange(-(-n // engine.block_size), dtype=torch.int32)[None],
        max_query_len=n,
        max_seq_len=n,
        query_lens_cpu=[n],
        seq_lens_cpu=[n],
    )
    r = engine.runner
    hidden = r.model.forward(torch.tensor(ids), torch.arange(n), r.kv_caches, meta, r.backend)
    return r.model.compute_logits(hidden)


def test_prompt_products_stay_dense_and_decode_products_use_int4():
    dense, int4 = _engine("dense"), _engine("int4")
    assert int4.model_info()["decode_weights"] == "int4"
    prompt = list(range(3, 3 + MAX_ROWS + 8))  # more rows than MAX_ROWS: the dense path
    torch.testing.assert_close(_logits(int4, prompt), _logits(dense, prompt), rtol=0, atol=0)
    short = prompt[:5]  # 5 rows: the 4-bit path, lossless weights, bf16 activations
    a, b = _logits(int4, short), _logits(dense, short)
    assert not torch.equal(a, b)
    torch.testing.assert_close(a, b, rtol=0, atol=0.02 * b.abs().max().item())


def test_int4_engine_generates_the_dense_engines_greedy_tokens_on_q4_weights():
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [list(range(5, 26)), list(range(40, 47)), [3] * 18]
    int4 = _engine("int4")
    assert int4.model.layers[0].qkv_int4 is not None
    ours = [o.token_ids for o in int4.generate(prompts, params)]
    assert ours == [o.token_ids for o in _engine("dense").generate(prompts, params)]
    assert int4.kv.pool.num_free == int4.num_blocks


def test_auto_picks_int4_on_the_cpu_and_dense_where_int4_cannot_run():
    from dataclasses import replace

    from engine_proc.models.llama import int4_unsupported_reason

    assert tiny_engine(decode_weights="auto").model_info()["decode_weights"] == "int4"
    config = tiny_checkpoint().config
    assert int4_unsupported_reason(config, torch.device("cpu")) is None
    assert "CPU only" in int4_unsupported_reason(config, torch.device("meta"))
    odd = replace(config, hidden_size=48)
    assert "hidden_size divisible by 32, got 48" in int4_unsupported_reason(
        odd, torch.device("cpu")
    )


def test_int4_is_refused_off_the_cpu_with_a_clear_error():
    from engine_proc.models.llama import LlamaModel

    ck = tiny_checkpoint()
    model = LlamaModel(ck.config, ck.weights, torch.float32, torch.device("cpu"), 64)
    model.device = torch.device("meta")  # what a GPU model looks like to the packing check
    with pytest.raises(ValueError, match="CPU only"):
        model._pack_int4()
