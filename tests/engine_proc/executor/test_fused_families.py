"""The fused CPU decode step on the families beyond Llama's layer (Qwen3's q/k head norms;
Gemma 3's sliding-window layers over the hybrid KV cache, local rotary base, sandwich norms,
GELU-tanh MLP, scaled embeddings and attention scale; Mistral's window on every layer),
against transformers' own float32 forward and generate() of the same weights.

The tiny checkpoints' linear weights are snapped to 4-bit Q4_1 levels and the output
projection to bfloat16 values, so the int4 engine's 4-bit copies are lossless and its precise
fused steps (up to PRECISE_ROWS rows) compute transformers' float32 model. With the AVX2
kernel's float32 products (run on every x86 CPU here: the bf16 arithmetic is pinned off) the
logits must be transformers' within 1e-4 and the greedy tokens generate()'s; the AVX512-BF16
kernel's bfloat16 activation pairs, where the CPU has it, within 2^-14 of each logit's sum of
magnitudes (test_int4.py's budget for these products), each token the reference's choice up to
that budget."""

from __future__ import annotations

import pytest
import torch

from engine_proc import EngineConfig, LLMEngine, SamplingParams
from engine_proc.executor import fused_decode as fd
from engine_proc.models import layers
from engine_proc.models.config import ModelConfig
from engine_proc.models.int4 import int4_kernels_available
from tests.engine_proc.models.test_int4 import q4_1_matrix
from tests.float64_llama import bf16_round
from tests.tiny_models import hf_reference_model, tiny_model_dir

pytestmark = pytest.mark.skipif(
    not int4_kernels_available(), reason="this torch build has no int4 CPU kernels"
)

PROMPT = torch.randint(3, 49152, (45,), generator=torch.Generator().manual_seed(3)).tolist()
NEW_TOKENS = 10
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
# GQA with head_dim = hidden / heads; MQA with head_dim != hidden / heads and tied embeddings
QWEN3_LAYOUTS = {
    "gqa": {"num_heads": 4, "num_kv_heads": 2},
    "mqa-hd32-tied": {"num_heads": 4, "num_kv_heads": 1, "head_dim": 32,
                      "tie_word_embeddings": True},
}  # fmt: skip
# Gemma 3: windows shorter than the prompt, sliding and full layers (a hybrid KV cache of
# several groups), query_pre_attn_scalar other than head_dim, tied embeddings (its default)
GEMMA3_LAYOUTS = {
    "window8-gqa": {"num_heads": 4, "num_kv_heads": 2, "num_layers": 4, "sliding_window": 8,
                    "layer_types": ("sliding_attention", "sliding_attention",
                                    "full_attention", "sliding_attention"),
                    "query_pre_attn_scalar": 24, "tie_word_embeddings": True},
    "window21-mqa-hd32": {"num_heads": 4, "num_kv_heads": 1, "head_dim": 32, "num_layers": 3,
                          "sliding_window": 21, "tie_word_embeddings": True},
}  # fmt: skip
# Mistral: a sliding window on every layer (no full-attention group), shorter than the prompt
MISTRAL_LAYOUTS = {
    "window8-gqa": {"num_heads": 4, "num_kv_heads": 2, "num_layers": 2, "sliding_window": 8},
    "window13-mqa-hd32": {"num_heads": 4, "num_kv_heads": 1, "head_dim": 32, "num_layers": 2,
                          "sliding_window": 13},
}  # fmt: skip
ALL_LAYOUTS = {"qwen3": QWEN3_LAYOUTS, "gemma3": GEMMA3_LAYOUTS, "mistral": MISTRAL_LAYOUTS}
_snapped: dict[str, object] = {}


def snapped_dir(tmp_path_factory, architecture: str, **params):
    """tiny_model_dir(architecture, **params) with every linear weight of the layers replaced by
    Q4_1 levels and the output projection rounded to bfloat16 values, saved with transformers."""
    key = f"{architecture}-{sorted(params.items())}"
    if key not in _snapped:
        source = tiny_model_dir(architecture, **params)
        model = hf_reference_model(source)
        with torch.no_grad():
            for i, (name, p) in enumerate(sorted(model.named_parameters())):
                if p.dim() == 2 and ".layers." in name:
                    p.copy_(q4_1_matrix(*p.shape, seed=i)[0])
            head = model.get_output_embeddings().weight
            head.copy_(bf16_round(head))
        out = tmp_path_factory.mktemp("snapped")
        model.save_pretrained(str(out))
        for item in source.iterdir():
            if "token" in item.name or item.name.endswith(".jinja"):
                (out / item.name).write_bytes(item.read_bytes())
        _snapped[key] = out
    return _snapped[key]


def test_qwen3_and_gemma3_are_layers_the_fused_step_computes():
    base = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2,
                num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4,
                max_position_embeddings=128, tie_word_embeddings=False,
                attention_bias=False)  # fmt: skip
    qwen3 = ModelConfig(architecture="Qwen3ForCausalLM", qk_norm=True, **base)
    assert fd.architecture_unsupported_reason(qwen3) is None
    gemma3 = ModelConfig(architecture="Gemma3ForCausalLM", qk_norm=True, sandwich_norms=True,
                         hidden_act="gelu_tanh", **base)  # fmt: skip
    assert fd.architecture_unsupported_reason(gemma3) is None
    mixtral = ModelConfig(architecture="MixtralForCausalLM", num_experts=4,
                          num_experts_per_tok=2, **base)  # fmt: skip
    assert "routed experts" in (fd.architecture_unsupported_reason(mixtral) or "")


def _engine(path, decode_step: str, block_size: int = 16) -> LLMEngine:
    # float32 K/V: the references' keys and values are exact
    return LLMEngine(EngineConfig(model=str(path), num_kv_blocks=400, decode_weights="int4",
                                  decode_step=decode_step, kv_cache_dtype="fp32",
                                  block_size=block_size))  # fmt: skip


def _reference_greedy(ref, prompt: list[int]) -> list[int]:
    out = ref.generate(
        torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long), eos_token_id=None,
        pad_token_id=0,
    )  # fmt: skip
    return out[0, len(prompt) :].tolist()


LAYOUTS = [("qwen3", name, 16) for name in QWEN3_LAYOUTS] + [
    (arch, name, bs) for arch in ("gemma3", "mistral") for name in ALL_LAYOUTS[arch]
    for bs in (16, 7)
]


# the precise 4-bit kernels these tests hold to transformers, by the bf16 arithmetic that picks
# them (models.layers.cpu_has_native_bf16); budget: None, 1e-4 absolute; else that fraction of
# each logit's sum of magnitudes (measured at most 2^-15.0 on Gemma 3 window8, Zen 4)
PRECISE_KERNELS = {"avx2_fp32": (False, None), "avx512_bf16": (True, 2**-14)}


def _kernels(extension) -> list[str]:
    """avx2_fp32 on every CPU; avx512_bf16 as well where this one runs it."""
    native = extension.has_avx512_bf16() and fd.torch_int4_pack_block() == 64
    return ["avx2_fp32", "avx512_bf16"] if native else ["avx2_fp32"]


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "layout", "block_size"), LAYOUTS,
                         ids=[f"{a}-{n}-bs{b}" for a, n, b in LAYOUTS])  # fmt: skip
def test_fused_steps_compute_transformers_forward(
    extension, tmp_path_factory, monkeypatch, arch, layout, block_size
):
    params = ALL_LAYOUTS[arch][layout]
    path = snapped_dir(tmp_path_factory, arch, **params)
    ref = hf_reference_model(path)
    rows: dict[int, torch.Tensor] = {}  # position -> the fused step's final-norm hidden state
    forward_rows = fd.FusedDecodeStep.forward_rows

    def recording(self, input_ids, positions, *args, **kwargs):
        hidden = forward_rows(self, input_ids, positions, *args, **kwargs)
        rows.update(zip(positions.tolist(), hidden, strict=True))
        return hidden

    monkeypatch.setattr(fd.FusedDecodeStep, "forward_rows", recording)
    create = fd.FusedDecodeStep.create
    for kernel in _kernels(extension):
        native, budget = PRECISE_KERNELS[kernel]
        monkeypatch.setattr(layers, "cpu_has_native_bf16", lambda native=native: native)
        # the AVX2 family whole: its attention kernel too, where AVX-512's would run
        attention = "avx2" if kernel == "avx2_fp32" and extension.has_avx2() else None
        monkeypatch.setattr(fd.FusedDecodeStep, "create", classmethod(
            lambda cls, *a, attention=attention, **kw: create(*a, attention_kernel=attention, **kw)
        ))  # fmt: skip
        engine = _engine(path, "fused", block_size)
        if "layer_types" in params or arch == "gemma3":  # the hybrid cache: sliding groups
            assert engine.runner.layout is not None and engine.runner.layout.is_hybrid
        # Mistral's window on every layer: one sliding table, releasing blocks (the fused step
        # visits only the window's, which the 45-token prompt against windows of 8 and 13 tests)
        assert engine.kv_layout.has_sliding_groups == ("sliding_window" in params)
        step = engine.runner.fused.step
        assert engine.runner.fused.state == "fused" and step is not None
        assert step.int4_kernel == kernel and step.attention_kernel == attention
        rows.clear()
        (out,) = engine.generate([PROMPT], GREEDY)
        # the prompt (as fused rows where it fits in one chunk) and every decode step ran fused
        assert engine.runner.num_fused_steps >= NEW_TOKENS - 1
        seq = PROMPT + out.token_ids[:-1]
        with torch.no_grad():
            expected = ref(torch.tensor([seq])).logits[0].double()
        positions = sorted(rows)
        assert positions[-1] == len(seq) - 1 and len(positions) >= NEW_TOKENS - 1
        hidden = torch.stack([rows[p] for p in positions]).double()
        head = ref.get_output_embeddings().weight.double()
        logits, expected = hidden @ head.T, expected[positions]
        if budget is None:
            assert out.token_ids == _reference_greedy(ref, PROMPT)
            torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
            continue
        tol = budget * (hidden.abs() @ head.abs().T)
        assert ((logits - expected).abs() <= tol).all(), ((logits - expected).abs() / tol).max()
        # teacher-forced on the engine's tokens: each the reference's argmax up to the budget
        first = len(PROMPT) - 1  # the position whose logits chose the first new token
        for want, room, p in zip(expected, tol, positions, strict=True):
            if p >= first:
                token = out.token_ids[p - first]
                assert want[token] + room[token] >= (want - room).max(), (p, token)


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "layout"), [("qwen3", "gqa"), ("gemma3", "window8-gqa"),
                                             ("mistral", "window8-gqa")])
def test_batched_fused_decoding_gives_the_eager_and_reference_tokens(
    extension, tmp_path_factory, monkeypatch, arch, layout
):
    """Three sequences a step (precise products), the same tokens as the eager int4 engine and
    as generate() one prompt at a time: float32 arithmetic on every CPU (the bf16 branch pinned
    off, which would also give the eager engine's short steps its bfloat16 output projection)."""
    monkeypatch.setattr(layers, "cpu_has_native_bf16", lambda: False)
    path = snapped_dir(tmp_path_factory, arch, **ALL_LAYOUTS[arch][layout])
    ref = hf_reference_model(path)
    prompts = [PROMPT[:20], PROMPT[20:27], [5] * 18]
    fused, eager = _engine(path, "fused"), _engine(path, "eager")
    got = [o.token_ids for o in fused.generate(prompts, GREEDY)]
    assert fused.runner.num_fused_steps >= NEW_TOKENS - 1
    assert got == [o.token_ids for o in eager.generate(prompts, GREEDY)]
    assert got == [_reference_greedy(ref, p) for p in prompts]
