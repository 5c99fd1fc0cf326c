"""The routed-experts layer (engine_proc/models/moe.py) against a brute-force per-token loop
written here (softmax over every expert, top-k by sorting, each chosen expert's MLP run on the
one token); the checkpoint layouts the loader stacks; what is refused and what falls back."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
import torch.nn.functional as F

from engine_proc import EngineConfig, LLMEngine, SamplingParams
from engine_proc.loading.loader import load_checkpoint
from engine_proc.models.int4 import int4_kernels_available
from engine_proc.models.layers import Linear
from engine_proc.models.moe import RoutedExperts, moe_mlp
from tests.tiny_models import tiny_moe_gguf_file, tiny_moe_model_dir


def _experts(num_experts: int, top_k: int, renormalize: bool, hidden: int = 64,
             width: int = 64, seed: int = 0) -> RoutedExperts:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    return RoutedExperts(
        router=torch.randn(num_experts, hidden, generator=gen) * (3 / hidden**0.5),
        gate_up=torch.randn(num_experts, 2 * width, hidden, generator=gen) / hidden**0.5,
        down=torch.randn(num_experts, hidden, width, generator=gen) / width**0.5,
        top_k=top_k, renormalize=renormalize,
    )  # fmt: skip


def _brute_force(x: torch.Tensor, ex: RoutedExperts) -> torch.Tensor:
    """One token at a time, in float64: every expert's probability, the k best by sorting."""
    width = ex.down.shape[2]
    rows = []
    for token in x.double():
        probs = torch.softmax(ex.router.double() @ token, dim=0).tolist()
        best = sorted(range(len(probs)), key=lambda e: -probs[e])[: ex.top_k]
        total = sum(probs[e] for e in best) if ex.renormalize else 1.0
        out = torch.zeros_like(token)
        for e in best:
            gate_up = ex.gate_up[e].double() @ token
            hidden = F.silu(gate_up[:width]) * gate_up[width:]
            out += probs[e] / total * (ex.down[e].double() @ hidden)
        rows.append(out)
    return torch.stack(rows).float()


@pytest.mark.parametrize(("num_experts", "top_k", "renormalize", "tokens"),
                         [(8, 2, True, 3), (8, 2, False, 40), (6, 3, True, 17), (4, 1, False, 9),
                          (5, 5, True, 2)])  # fmt: skip
def test_moe_mlp_matches_a_per_token_loop(num_experts, top_k, renormalize, tokens):
    ex = _experts(num_experts, top_k, renormalize)
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens))
    counts = torch.zeros(num_experts, dtype=torch.int64)
    out = moe_mlp(x, ex, F.silu, Linear(torch.device("cpu"), torch.float32), counts)
    torch.testing.assert_close(out, _brute_force(x, ex), atol=2e-5, rtol=1e-4)
    assert int(counts.sum()) == tokens * top_k
    if tokens * top_k < num_experts:  # 3 tokens x 2 of 8 experts: some experts get no token
        assert (counts == 0).any()
    moe_mlp(x, ex, F.silu, Linear(torch.device("cpu"), torch.float32), counts)
    assert int(counts.sum()) == 2 * tokens * top_k  # accumulated, not replaced


def test_an_empty_batch_routes_nothing():
    ex = _experts(4, 2, True)
    counts = torch.zeros(4, dtype=torch.int64)
    out = moe_mlp(torch.zeros(0, 64), ex, F.silu, Linear(torch.device("cpu"), torch.float32),
                  counts)  # fmt: skip
    assert out.shape == (0, 64) and int(counts.sum()) == 0


def _min_max_4bit(w: torch.Tensor) -> torch.Tensor:
    """Each group of 32 inputs rounded to 16 levels between its min and max (GGUF Q4_1)."""
    groups = w.reshape(*w.shape[:-1], -1, 32)
    low = groups.amin(-1, keepdim=True)
    step = (groups.amax(-1, keepdim=True) - low) / 15
    return (torch.round((groups - low) / step) * step + low).reshape(w.shape)


@pytest.mark.skipif(not int4_kernels_available(), reason="torch lacks the int4 CPU kernels")
def test_int4_experts_are_each_experts_own_quantization():
    """Decode-sized batches read each expert's 4-bit copy: the per-token loop over 4-bit-rounded
    experts, up to the kernel's bfloat16 activations and scales (a mixed-up expert would be off
    by as much as the experts differ); the dense layer exactly where int4 is off."""
    ex = _experts(8, 2, True)
    ex.pack_int4()
    assert ex.gate_up_int4 is not None and len(ex.gate_up_int4) == 8
    linear = Linear(torch.device("cpu"), torch.float32)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    rounded = RoutedExperts(ex.router, _min_max_4bit(ex.gate_up), _min_max_4bit(ex.down), 2, True)
    q4 = moe_mlp(x, ex, F.silu, linear, use_int4=True)
    dense = moe_mlp(x, ex, F.silu, linear, use_int4=False)
    torch.testing.assert_close(dense, _brute_force(x, ex), atol=2e-5, rtol=1e-4)
    ref = _brute_force(x, rounded)
    error = (q4 - ref).norm() / ref.norm()
    dense_error = (dense - ref).norm() / ref.norm()
    assert error < 0.03 and error < dense_error / 3, (error, dense_error)


# --------------------------------------------------------------------------------------------
# checkpoint layouts


def _fused_copy(src, tmp_path):
    """The per-expert checkpoint rewritten in transformers 5's fused in-memory layout."""
    from safetensors.torch import load_file, save_file

    weights = load_file(str(src / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    out = {}
    for name, value in weights.items():
        if ".experts." not in name:
            out[name] = value
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp.experts."
        n = config["num_local_experts"]
        if f"{p}0.gate_proj.weight" not in weights:
            continue
        out[p + "gate_up_proj"] = torch.stack([
            torch.cat([weights[f"{p}{e}.gate_proj.weight"], weights[f"{p}{e}.up_proj.weight"]])
            for e in range(n)])  # fmt: skip
        out[p + "down_proj"] = torch.stack([weights[f"{p}{e}.down_proj.weight"] for e in range(n)])
    dst = tmp_path / "fused"
    shutil.copytree(src, dst)
    save_file(out, str(dst / "model.safetensors"))
    return dst


def test_fused_and_per_expert_checkpoints_load_the_same_weights(tmp_path):
    src = tiny_moe_model_dir("qwen3_moe", num_experts=6, num_experts_per_tok=3, num_layers=3,
                             mlp_only_layers=(1,))  # fmt: skip
    per_expert = load_checkpoint(src, torch.float32)
    fused = load_checkpoint(_fused_copy(src, tmp_path), torch.float32)
    assert fused.config == per_expert.config
    assert fused.weights.keys() == per_expert.weights.keys()
    for name, value in per_expert.weights.items():
        assert torch.equal(fused.weights[name], value), name
    # and the stacked tensors are the saved experts', gate rows before up rows
    from safetensors.torch import load_file

    saved = load_file(str(src / "model.safetensors"))
    stacked = per_expert.weights["model.layers.2.mlp.experts.gate_up_proj"]
    assert torch.equal(stacked[4, :48], saved["model.layers.2.mlp.experts.4.gate_proj.weight"])
    assert torch.equal(stacked[4, 48:], saved["model.layers.2.mlp.experts.4.up_proj.weight"])


def test_a_missing_expert_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    src = tiny_moe_model_dir("mixtral")
    dst = tmp_path / "broken"
    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    del weights["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    save_file(weights, str(dst / "model.safetensors"))
    with pytest.raises(ValueError, match=r"3\.5 of 4 experts.*layers\.1\.mlp\.experts\.gate_up"):
        load_checkpoint(dst, torch.float32)


def test_unsupported_architectures_are_refused_listing_the_moe_families():
    from engine_proc.models.registry import family_for_gguf, family_for_hf

    with pytest.raises(ValueError) as hf:
        family_for_hf(["DeepseekV3ForCausalLM"], "here")
    assert "Qwen3MoeForCausalLM" in str(hf.value) and "MixtralForCausalLM" in str(hf.value)
    with pytest.raises(ValueError) as gg:
        family_for_gguf("deepseek2", "", "here")
    assert "qwen3moe" in str(gg.value) and "MixtralForCausalLM" in str(gg.value)
    assert family_for_gguf("llama", "Mistral 8x7B", "here", expert_count=8).name == "mixtral"


@pytest.mark.parametrize(("field", "value", "message"), [
    ("num_experts_per_tok", 5, r"num_experts_per_tok=5 .*expected 1\.\.4"),
    ("mlp_only_layers", [2], r"mlp_only_layers=\[2\].*0\.\.1"),
    ("decoder_sparse_step", 0, "decoder_sparse_step=0"),
])  # fmt: skip
def test_bad_expert_fields_are_named(tmp_path, field, value, message):
    src = tiny_moe_model_dir("qwen3_moe")
    dst = tmp_path / "bad"
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config[field] = value
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        load_checkpoint(dst, torch.float32)


# --------------------------------------------------------------------------------------------
# what cannot run fast says why


def test_the_fused_cpu_step_names_routed_experts():
    from engine_proc.executor.fused_decode import architecture_unsupported_reason

    mixtral = load_checkpoint(tiny_moe_model_dir("mixtral"), torch.float32).config
    assert architecture_unsupported_reason(mixtral) == "has no routed experts (MixtralForCausalLM)"


def test_auto_decode_weights_fall_back_to_dense_with_the_reason_logged(caplog):
    caplog.set_level(logging.INFO, logger="engine_proc.engine.llm_engine")
    # experts 48 wide: torch's int4 kernel packs groups of 32
    engine = LLMEngine(EngineConfig(model=str(tiny_moe_model_dir("qwen3_moe")),
                                    decode_weights="auto", num_kv_blocks=32))  # fmt: skip
    assert engine.decode_weights == "dense"
    if int4_kernels_available():
        assert "moe_intermediate_size divisible by 32, got 48" in caplog.text
    (out,) = engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, temperature=0))
    assert len(out.token_ids) == 3


@pytest.mark.skipif(not int4_kernels_available(), reason="torch lacks the int4 CPU kernels")
def test_auto_decode_weights_quantize_each_expert_where_they_can(caplog):
    """The app's CPU defaults (auto weights, fused step): 4-bit experts, decoded eagerly with
    the fused step's refusal logged."""
    caplog.set_level(logging.WARNING, logger="engine_proc.executor.fused_lifecycle")
    path = tiny_moe_gguf_file("mixtral", intermediate_size=64)
    engine = LLMEngine(EngineConfig(model=str(path), decode_weights="auto", decode_step="fused",
                                    num_kv_blocks=32))  # fmt: skip
    assert engine.decode_weights == "int4" and engine.runner.fused.state == "eager"
    assert "has no routed experts (MixtralForCausalLM)" in caplog.text
    experts = engine.model.layers[0].experts
    assert experts is not None and experts.down_int4 is not None
    assert len(experts.down_int4) == engine.model_config.num_experts
    prompt = list(range(100, 120))
    dense = LLMEngine(EngineConfig(model=str(path), num_kv_blocks=32))
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    (q4,) = engine.generate([prompt], greedy)
    (ref,) = dense.generate([prompt], greedy)
    assert q4.token_ids[0] == ref.token_ids[0]  # the prefill is the dense model's
    assert len(q4.token_ids) == 6
