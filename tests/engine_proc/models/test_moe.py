"""Routed-experts families (Qwen3-MoE, Mixtral) against transformers' own float32 forward and
generate(), on tiny random checkpoints saved by transformers (one tensor per expert): logits at
every position of a prompt run through chunked prefill and the paged cache (block sizes 16 and
7), greedy tokens, a second pass from the prefix cache, preemption under a small pool, and the
same weights from a GGUF in llama.cpp's layout (stacked `_exps` tensors)."""

from __future__ import annotations

import pytest

from engine_proc import EngineConfig, LLMEngine
from tests.engine_proc.models.family_checks import (
    GREEDY,
    NEW_TOKENS,
    PROMPT,
    check_gguf,
    check_llama_cpp,
    check_logits_and_greedy,
    check_preemption,
    checkpoint_path,
    engine_for,
)
from tests.tiny_models import hf_reference_model, tiny_model_dir, tiny_moe_gguf_file

# (architecture, tiny_moe_model_dir parameters)
LAYOUTS = {
    "qwen3moe-gqa-head_dim32-8x2": ("qwen3_moe", dict(num_experts=8, head_dim=32)),
    "qwen3moe-mqa-tied-unnormalised": (
        "qwen3_moe", dict(num_kv_heads=1, tie_word_embeddings=True, norm_topk_prob=False)),
    "qwen3moe-6x3-dense-middle-layer": (
        "qwen3_moe", dict(num_experts=6, num_experts_per_tok=3, num_layers=3,
                          mlp_only_layers=(1,))),
    "qwen3moe-mha-sparse-step2": ("qwen3_moe", dict(num_kv_heads=4, decoder_sparse_step=2)),
    "mixtral-gqa-8x2": ("mixtral", dict(num_experts=8)),
    "mixtral-mqa-tied-window5": (
        "mixtral", dict(num_kv_heads=1, tie_word_embeddings=True, sliding_window=5)),
    "mixtral-mha-head_dim32": ("mixtral", dict(num_kv_heads=4, head_dim=32)),
}  # fmt: skip


def _path(name: str):
    return checkpoint_path(LAYOUTS[name])


def _engine(name: str, block_size: int = 16, **overrides) -> LLMEngine:
    return engine_for(LAYOUTS[name], block_size, **overrides)


CASES = [(name, 16) for name in LAYOUTS] + [
    ("qwen3moe-6x3-dense-middle-layer", 7), ("mixtral-mqa-tied-window5", 7)]  # fmt: skip


@pytest.mark.parametrize(("name", "block_size"), CASES, ids=[f"{n}-bs{b}" for n, b in CASES])
def test_logits_and_greedy_tokens_match_transformers(name, block_size):
    arch, params = LAYOUTS[name]
    engine = check_logits_and_greedy(LAYOUTS[name], block_size, PROMPT)
    config = engine.model_config
    assert config.architecture == {"qwen3_moe": "Qwen3MoeForCausalLM",
                                   "mixtral": "MixtralForCausalLM"}[arch]  # fmt: skip
    assert config.num_experts == params.get("num_experts", 4)
    assert config.num_experts_per_tok == params.get("num_experts_per_tok", 2)
    assert config.norm_topk_prob == (arch == "mixtral" or params.get("norm_topk_prob", True))
    window = params.get("sliding_window")
    assert config.sliding_window == window and (window is None or window < len(PROMPT))


def test_dense_layers_follow_mlp_only_layers_and_decoder_sparse_step():
    """transformers' rule: a layer is sparse unless listed in mlp_only_layers or (i + 1) is no
    multiple of decoder_sparse_step; its dense MLP is intermediate_size wide."""
    middle = _engine("qwen3moe-6x3-dense-middle-layer")
    assert middle.model_config.dense_mlp_layers == (1,)
    assert [layer.experts is not None for layer in middle.model.layers] == [True, False, True]
    assert middle.model.layers[1].down_weight.shape == (64, 96)
    step2 = _engine("qwen3moe-mha-sparse-step2")
    assert step2.model_config.dense_mlp_layers == (0,)
    ref = hf_reference_model(_path("qwen3moe-mha-sparse-step2"))
    assert [hasattr(layer.mlp, "experts") for layer in ref.model.layers] == [False, True]


@pytest.mark.parametrize("name", ["qwen3moe-6x3-dense-middle-layer", "mixtral-mqa-tied-window5"])
def test_preemption_under_a_small_pool_changes_no_token(name):
    check_preemption(LAYOUTS[name])


@pytest.mark.parametrize("name", ["qwen3moe-6x3-dense-middle-layer", "mixtral-gqa-8x2"])
def test_expert_counts_sum_to_tokens_times_top_k_per_layer(name):
    engine = _engine(name)
    config = engine.model_config
    counts = engine.model.expert_counts
    assert counts is not None and counts.shape == (config.num_layers, config.num_experts)
    counts.zero_()
    engine.generate([PROMPT], GREEDY)
    # every prompt token and every generated token but the last went through the model once
    tokens = len(PROMPT) + NEW_TOKENS - 1
    for layer in range(config.num_layers):
        want = 0 if layer in config.dense_mlp_layers else tokens * config.num_experts_per_tok
        assert int(counts[layer].sum()) == want
    assert (counts >= 0).all() and int((counts > 0).sum()) > config.num_experts  # spread out


def test_expert_counts_reach_the_telemetry_wire():
    """The running totals in the engine snapshot and, through the server's conversion and
    MessagePack, in the published Telemetry (docs/PROTOCOL.md `expert_counts`)."""
    import ipc.protocol as P
    from engine_proc.server.wire import telemetry_from_snapshot

    engine = _engine("qwen3moe-6x3-dense-middle-layer")
    engine.generate([PROMPT], GREEDY)
    snap = engine.snapshot()
    assert snap.expert_counts == engine.model.expert_counts.tolist()
    msg = P.decode_pub(P.encode(telemetry_from_snapshot(snap, 1, False, 0)))
    assert msg.expert_counts == snap.expert_counts
    assert sum(msg.expert_counts[1]) == 0 and sum(msg.expert_counts[0]) > 0
    dense = LLMEngine(EngineConfig(model=str(tiny_model_dir("qwen3")), num_kv_blocks=16))
    assert dense.model.expert_counts is None and dense.snapshot().expert_counts == []


GGUF_LAYOUTS = ["qwen3moe-gqa-head_dim32-8x2", "qwen3moe-6x3-dense-middle-layer",
                "mixtral-gqa-8x2", "mixtral-mha-head_dim32"]  # fmt: skip


@pytest.mark.parametrize("name", GGUF_LAYOUTS)
def test_a_gguf_of_the_same_weights_gives_transformers_logits(name):
    """llama.cpp's layout (tests/tiny_models/ writes it as convert_hf_to_gguf.py does: experts
    stacked into ffn_{gate,up,down}_exps, the router as ffn_gate_inp, expert_count,
    expert_used_count and (qwen3moe) expert_feed_forward_length; Mixtral as `llama`)."""
    check_gguf(LAYOUTS[name], PROMPT)


def test_gguf_tensor_names_are_llama_cpps():
    import gguf

    from engine_proc.loading.gguf_file import GgufFile

    names = set(GgufFile(tiny_moe_gguf_file("qwen3_moe", num_experts=8, head_dim=32)).tensors)
    allowed = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.QWEN3MOE]}
    per_layer = {n.replace("blk.0.", "blk.{bid}.").rsplit(".", 1)[0] for n in names}
    assert {"blk.{bid}.ffn_gate_inp", "blk.{bid}.ffn_gate_exps", "blk.{bid}.ffn_up_exps",
            "blk.{bid}.ffn_down_exps"} <= per_layer  # fmt: skip
    assert {n for n in per_layer if "{bid}" in n} <= allowed


@pytest.mark.parametrize("name", ["qwen3moe-gqa-head_dim32-8x2", "mixtral-gqa-8x2"])
def test_llama_cpp_reads_the_test_gguf_as_transformers_does(name):
    """The GGUF writer checked by a reader we did not write (optional: llama-cpp-python)."""
    check_llama_cpp(LAYOUTS[name], PROMPT)
