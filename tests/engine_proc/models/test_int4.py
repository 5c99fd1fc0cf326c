"""4-bit decode weights (engine_proc/models/int4.py): the kernel against brute-force
dequantized matrices, exact recovery of Q4_1-style weights, and the model's routing (prompt
products dense, decode products 4-bit) and greedy decoding against a float64 reference of the
same arithmetic (tests/float64_llama.py), under both bf16 arithmetics (the ``native_bf16``
fixture: which one runs is otherwise the CPU's choice)."""

import pytest
import torch

from engine_proc import EngineConfig, LLMEngine, SamplingParams
from engine_proc.attention.base import AttentionMetadata
from engine_proc.models import layers, llama
from engine_proc.models.int4 import (
    GROUP_SIZE,
    MAX_ROWS,
    int4_kernels_available,
    int4_matmul,
    quantize_int4,
)
from tests.engine_fixtures import tiny_checkpoint, tiny_engine, tiny_hf_model
from tests.float64_llama import bf16_round, bf16_ulp, llama_forward

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


def assert_within(got: torch.Tensor, ref: torch.Tensor, tol: torch.Tensor) -> None:
    error = (got.double() - ref).abs()
    assert (error <= tol).all(), f"error up to {float((error / tol).max()):.3g} x the tolerance"


def assert_bf16_product(
    got: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> None:
    """got must be x @ weight.T as torch computes it from bfloat16 activations: x rounded to
    bf16, exact products summed in float32, the sum rounded to bf16 (then + bias in float32).
    The float32 sum is within (n + 2) * 2^-24 * sum|x w| of the exact one (n terms; the kernel's
    dequantization may round once or twice more), so its bf16 rounding and that of the exact
    sum are at most one bf16 step apart."""
    x64 = bf16_round(x.double())
    w64 = weight.double()
    exact = x64 @ w64.t()
    ref = bf16_round(exact)
    unbiased = got.double()
    if bias is not None:
        ref = ref + bias.double()
        unbiased = unbiased - bias.double()
    sum_error = (x.shape[1] + 2) * 2**-24 * (x64.abs() @ w64.abs().t())
    step = bf16_ulp(torch.maximum(unbiased.abs(), exact.abs()))
    assert_within(got, ref, step + sum_error + 2**-23 * got.double().abs())  # + the bias add


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
    from engine_proc.models.layers import Linear

    weight, _ = q4_1_matrix(64, 96, seed=3)
    bias = torch.randn(64)
    packed = quantize_int4(weight)
    linear = Linear(torch.device("cpu"), torch.float32)
    for rows in (1, MAX_ROWS, MAX_ROWS + 1):
        x = torch.randn(rows, 96)
        got = linear(x, weight, bias, packed)
        if rows <= MAX_ROWS:  # 4-bit path: bf16 activations, lossless weights
            assert not torch.equal(got, torch.nn.functional.linear(x, weight, bias))
            assert_bf16_product(got, x, weight, bias)
        else:  # dense path, bit for bit
            assert torch.equal(got, torch.nn.functional.linear(x, weight, bias))
    x = torch.randn(96, 4).t()  # a non-contiguous view (a slice of a fused output)
    assert_bf16_product(linear(x, weight, None, packed), x, weight)


def test_rejects_shapes_it_cannot_pack():
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize_int4(torch.randn(8, 48))
    with pytest.raises(ValueError, match="2-D"):
        quantize_int4(torch.randn(8))


def test_engine_config_rejects_unknown_decode_weights():
    with pytest.raises(ValueError, match=r"one of \('dense', 'int4', 'auto'\), got 'int3'"):
        tiny_engine(decode_weights="int3")


# Up to how many rows the int4 mode computes logits with its bf16 output projection: every
# decode-sized step with native bf16, one or two rows without (models.layers.bf16_lm_head_rows).
BF16_HEAD_ROWS = {False: 2, True: MAX_ROWS}


def snapped_checkpoint():
    """The tiny model with every linear weight replaced by a matrix built from random 4-bit
    codes, bf16 scales and offsets (what a GGUF Q4_1 file dequantizes to, built independently of
    the quantizer) and the output projection rounded to bf16 values. The 4-bit copies and the
    bf16 output projection are then lossless: the int4 engine differs from the dense one only
    by rounding activations (and, with the bf16 head, hidden states and logits) to bf16."""
    ck = tiny_checkpoint()
    for i, (name, w) in enumerate(sorted(ck.weights.items())):
        if w.dim() == 2 and "embed" not in name and "lm_head" not in name:
            ck.weights[name], _ = q4_1_matrix(*w.shape, seed=i)
    ck.weights["lm_head.weight"] = bf16_round(ck.weights["lm_head.weight"])
    return ck


def _engine(decode_weights: str):
    # float32 K/V beside the 4-bit weights too (their default is fp16): these tests compare
    # the products, against references with exact K/V
    return LLMEngine(
        EngineConfig(num_kv_blocks=64, decode_weights=decode_weights, kv_cache_dtype="fp32"),
        checkpoint=snapped_checkpoint(),
    )


def _logits(engine, ids):
    """(final hidden states, logits) of one fresh sequence run as a single step."""
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
    return hidden, r.model.compute_logits(hidden)


def _decode_logits(engine, ids):
    """(final hidden states, logits) of a decode-shaped step: each id its own one-token
    sequence (position 0), as many rows as ids."""
    n, bs = len(ids), engine.block_size
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n) * bs,  # one block each
        query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=torch.ones(n, dtype=torch.int32),
        block_tables=torch.arange(n, dtype=torch.int32)[:, None],
        max_query_len=1,
        max_seq_len=1,
        query_lens_cpu=[1] * n,
        seq_lens_cpu=[1] * n,
    )
    r = engine.runner
    hidden = r.model.forward(torch.tensor(ids), torch.zeros(n, dtype=torch.long), r.kv_caches,
                             meta, r.backend)  # fmt: skip
    return hidden, r.model.compute_logits(hidden)


def _sum_of_magnitudes(hidden: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """sum_i |h_i w_ji| for every logit j: the scale of a logit's rounding errors."""
    return hidden.double().abs() @ head.double().abs().t()


def test_the_float64_reference_is_the_transformers_model():
    ck = snapped_checkpoint()
    hf = tiny_hf_model().__class__(tiny_hf_model().config).double().eval()
    hf.load_state_dict(ck.weights)
    ids = list(range(3, 40))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    # transformers takes the rotary angles' cos/sin in float32 (errors ~1e-7) even in float64.
    ours = llama_forward(ck.config, ck.weights, ids).logits
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)


def test_prompt_products_stay_dense_and_decode_products_use_int4(native_bf16, monkeypatch):
    calls = []
    real_int4_matmul = layers.int4_matmul

    def spy(x, packed):
        out = real_int4_matmul(x, packed)
        calls.append((x.clone(), packed, out.clone()))
        return out

    monkeypatch.setattr(layers, "int4_matmul", spy)
    ck = snapped_checkpoint()
    dense, int4 = _engine("dense"), _engine("int4")
    assert int4.model_info()["decode_weights"] == "int4"
    head = ck.weights["lm_head.weight"]

    prompt = list(range(3, 3 + MAX_ROWS + 8))  # a prompt: the dense path
    hidden, logits = _logits(int4, prompt)
    assert calls == []
    assert torch.equal(logits, _logits(dense, prompt)[1])  # the same float32 products
    # ...however short: a prompt's first token is the dense model's
    assert torch.equal(_logits(int4, prompt[:5])[0], _logits(dense, prompt[:5])[0])
    assert calls == []
    # ...which are the model: float32 error (measured <= 22 * 2^-24 of the sum here), far below
    # what a wrong position, norm or layout would move.
    exact = llama_forward(ck.config, ck.weights, prompt)
    assert_within(logits, exact.logits, 2**-16 * _sum_of_magnitudes(hidden, head))

    short = prompt[:5]  # 5 decode rows: every product on the 4-bit copies
    hidden, logits = _decode_logits(int4, short)
    model_layers = int4.model.layers
    assert [x.shape[0] for x, _, _ in calls] == [len(short)] * 4 * len(model_layers)
    dense_weight = {}
    for layer in model_layers:
        dense_weight[id(layer.qkv_int4)] = layer.qkv_weight
        dense_weight[id(layer.o_int4)] = layer.o_weight
        dense_weight[id(layer.gate_up_int4)] = layer.gate_up_weight
        dense_weight[id(layer.down_int4)] = layer.down_weight
    assert len(dense_weight) == 4 * len(model_layers)
    for x, packed, out in calls:  # lossless weights: the bf16-activation product of the dense one
        assert_bf16_product(out, x, dense_weight[id(packed)])
    if len(short) <= BF16_HEAD_ROWS[native_bf16]:  # the bf16 copy of the (bf16-valued) head
        assert torch.equal(logits, bf16_round(logits))
        assert_bf16_product(logits, hidden, head)
    else:  # the float32 head: n-term float32 sums
        bound = (hidden.shape[1] + 1) * 2**-24 * _sum_of_magnitudes(hidden, head)
        assert_within(logits, hidden.double() @ head.double().t(), bound)


def test_int4_greedy_decoding_follows_a_float64_reference_of_its_arithmetic(native_bf16):
    """Every step's logits against the float64 reference of the arithmetic that step ran (4-bit
    products = bf16 activations on the lossless weights, dense prompt steps exact, bf16 or
    float32 head), teacher-forced on the engine's tokens; each greedy token must be the
    reference's choice up to that tolerance. No claim that the 4-bit engine picks the dense
    engine's tokens: this tiny random model has near-tied logits that bf16 rounding decides."""
    int4 = _engine("int4")
    assert int4.model.layers[0].qkv_int4 is not None
    check_greedy_decoding_against_reference(int4, native_bf16)


# What a decode step's 4-bit products compute, for the float64 reference: "bf16" bfloat16
# activations and outputs (torch's kernel); "bf16_in" bfloat16 activations, float32 outputs (the
# fused step's own kernels in wide steps); "exact" the dense float32 product (theirs in narrow
# steps: activations as bfloat16 pairs); "q8_mlp" the MLP's on 8-bit activations, the others
# exact (AVX2's wide steps); "q8" all four on 8-bit activations (AVX512-BF16's wide steps).
# q8_all: all four products and the output projection on 8-bit activations
# (decode_activations="int8")
DECODE_PRODUCTS = ("bf16", "bf16_in", "exact", "q8_mlp", "q8", "q8_all")


def check_greedy_decoding_against_reference(
    int4: LLMEngine,
    native_bf16: bool,
    ck=None,
    bf16_head_rows: int | None = None,
    decode_products: str = "bf16",
    kv_transform=None,
) -> None:
    """The body of the test above, for an int4 engine over ``ck`` (default snapped_checkpoint())
    whose logits of up to ``bf16_head_rows`` rows (default: BF16_HEAD_ROWS) come from the bf16
    output projection and whose decode products compute ``decode_products`` (one of
    DECODE_PRODUCTS); also run with the fused decode step
    (tests/engine_proc/executor/test_fused_decode.py). kv_transform: what the engine's KV cache
    stores of K and V (float64_llama.llama_forward's argument; None: exact)."""
    assert decode_products in DECODE_PRODUCTS, decode_products
    ck = ck or snapped_checkpoint()
    if bf16_head_rows is None:
        bf16_head_rows = BF16_HEAD_ROWS[native_bf16]
    step_rows: list[int] = []
    step_logits: list[torch.Tensor] = []
    execute = int4.runner.execute

    def recording_execute(batch):  # (a fused step's wide head included)
        step_rows.append(sum(batch.num_new_tokens))
        logits, seqs = execute(batch)
        step_logits.append(logits)
        return logits, seqs

    int4.runner.execute = recording_execute
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    batches = [
        # prefilled together (46 rows: dense products), then decoded 3 rows a step (4-bit)
        [list(range(5, 26)), list(range(40, 47)), [3] * 18],
        # a short prompt alone: prefilled on the dense weights too; decode one row a step
        [list(range(60, 67))],
    ]
    for prompts in batches:
        step_rows.clear()
        step_logits.clear()
        outs = [o.token_ids for o in int4.generate(prompts, params)]
        assert step_rows == [sum(map(len, prompts))] + [len(prompts)] * (params.max_tokens - 1)
        assert [len(s) for s in step_logits] == [len(prompts)] * params.max_tokens
        prefill_int4 = False  # prompts always run the dense weights...
        # ...or, under decode_activations="int8", rows of the fused step on 8-bit activations
        # (prompts of up to its max_prompt_tokens, as all of these are)
        prompt_q8 = decode_products == "q8_all"
        decode_bf16 = decode_products in ("bf16", "bf16_in")
        decode_q8 = decode_products in ("q8_mlp", "q8", "q8_all")  # float32 sums of 8-bit inputs
        head_bf16 = len(prompts) <= bf16_head_rows
        for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
            seq = prompt + out[:-1]
            ref = llama_forward(
                ck.config,
                ck.weights,
                seq,
                bf16_product_rows=[prefill_int4] * len(prompt) + [decode_bf16] * (len(out) - 1),
                bf16_head_rows=[head_bf16] * len(seq),
                bf16_product_outputs=decode_products == "bf16",
                q8_mlp_rows=[prompt_q8] * len(prompt) + [decode_q8] * (len(out) - 1),
                q8_attention_rows=[prompt_q8] * len(prompt)
                + [decode_products in ("q8", "q8_all")] * (len(out) - 1),
                q8_head_rows=[prompt_q8] * len(seq),
                kv_transform=kv_transform,
            )
            expected = ref.logits[len(prompt) - 1 :]
            got = torch.stack([logits[i] for logits in step_logits]).double()
            # The engine sums in float32, the reference in float64: a bf16 rounding goes the
            # other way where a value lies within float32 error of a rounding boundary, and
            # such a flip early on moves later values too. Budget: every element of the final
            # hidden state one bf16 step (2^-7 of it) off, plus one step of the logit's own
            # rounding. (float32 and float64 runs of the reference differ by at most 0.4 of
            # this on 60 random prompts with either head; a wrong offset is off by 75x.) With
            # no bf16 rounding anywhere, float32 sums: 2^-14 (single bf16 activations, 2^-9
            # relative, are off by more). 8-bit inputs: a float32 sum on the other side of a
            # code's rounding boundary moves that input by a step, max|x| / 127 of its group,
            # about one bf16 step of the group's largest: the bf16 budget. A float16 KV cache:
            # an element whose float32 value rounds the other way moves by one float16 step
            # (2^-11 of it).
            no_bf16 = not decode_bf16 and not head_bf16 and not decode_q8
            tol = 2 ** (-14 if no_bf16 and kv_transform is None else -11 if no_bf16 else -7)
            tol = tol * _sum_of_magnitudes(ref.hidden[len(prompt) - 1 :], ref.lm_head)
            tol = tol + bf16_ulp(expected)
            assert_within(got, expected, tol)
            for step, token in enumerate(out):  # argmax of logits within tol of the reference's
                best_rival = (expected[step] - tol[step]).max()
                assert expected[step, token] + tol[step, token] >= best_rival, (i, step, token)
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


@pytest.mark.parametrize("native", [False, True])
def test_the_bf16_branch_is_a_model_parameter_that_defaults_to_the_cpu_flags(native):
    ck, cpu = tiny_checkpoint(), torch.device("cpu")
    model = llama.LlamaModel(ck.config, ck.weights, torch.float32, cpu, 64, "int4", native)
    assert model.lm_head_decode_rows == BF16_HEAD_ROWS[native]
    model = llama.LlamaModel(ck.config, ck.weights, torch.bfloat16, cpu, 64, native_bf16=native)
    assert model.linear.upcast is not native
    default = llama.LlamaModel(ck.config, ck.weights, torch.float32, cpu, 64)
    assert default.native_bf16 is layers.cpu_has_native_bf16()


def test_int4_is_refused_off_the_cpu_with_a_clear_error():
    from engine_proc.models.llama import LlamaModel

    ck = tiny_checkpoint()
    model = LlamaModel(ck.config, ck.weights, torch.float32, torch.device("cpu"), 64)
    model.device = torch.device("meta")  # what a GPU model looks like to the packing check
    with pytest.raises(ValueError, match="CPU only"):
        model._pack_int4()
