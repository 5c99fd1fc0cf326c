"""engine_proc/catalog/inspect.py against independent readers: gguf's own GGUFReader and the
safetensors library for parameter counts, the registry's refusal for unsupported models, and the
loader's full load for the config."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from engine_proc.catalog.inspect import inspect
from engine_proc.catalog.stores import Found, discover
from engine_proc.loading.loader import load_checkpoint
from engine_proc.models.registry import supported_gguf_architectures, supported_hf_architectures
from tests.engine_proc.catalog.stores_fixture import env_for, make_home
from tests.tiny_models import tiny_gguf_file, tiny_model_dir


@pytest.fixture(scope="module")
def entries(tmp_path_factory):
    root = tmp_path_factory.mktemp("catalog")
    make_home(root)
    return {e.name: e for e in map(inspect, discover([root / "my-models"], env=env_for(root)))}


def _gguf_reader_params(path: Path) -> int:
    import gguf

    return sum(int(t.n_elements) for t in gguf.GGUFReader(str(path)).tensors)


def _safetensors_params(folder: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), framework="np") as h:
            total += sum(math.prod(h.get_slice(k).get_shape()) for k in h.keys())
    return total


def test_gguf_entry(entries):
    e = entries["tinyllama:latest"]
    assert e.supported and e.reason == ""
    assert e.architecture == "llama"
    assert e.params == _gguf_reader_params(Path(e.path))
    assert e.quantization == "F32"
    assert e.file_size == Path(e.path).stat().st_size
    reference = load_checkpoint(tiny_gguf_file("llama"), torch.float32).config
    assert e.config == reference
    assert e.context_length == reference.max_position_embeddings
    # the engine loads Ollama's suffixless blob as the GGUF it is
    assert load_checkpoint(e.path, torch.float32).config == reference


def test_safetensors_entry(entries):
    e = entries["tiny-org/tiny-llama"]
    assert e.supported, e.reason
    assert e.architecture == "LlamaForCausalLM"
    assert e.params == _safetensors_params(tiny_model_dir("llama"))
    assert e.quantization == "F32"
    assert e.config == load_checkpoint(tiny_model_dir("llama"), torch.float32).config


def test_refused_models_carry_the_registrys_reason(entries):
    bert, gpt2 = entries["tiny-bert"], entries["gpt2-tiny"]
    assert not bert.supported and bert.config is None
    assert "'bert' is not supported" in bert.reason
    assert all(a in bert.reason for a in supported_gguf_architectures())
    assert bert.params == 10 * 8 + 8 and bert.context_length == 128
    assert not gpt2.supported
    assert "GPT2LMHeadModel" in gpt2.reason
    assert all(a in gpt2.reason for a in supported_hf_architectures())
    assert gpt2.quantization == "F16" and gpt2.params == 88


def test_a_refused_field_is_named(tmp_path):
    import json
    import shutil

    d = tmp_path / "softcap"
    shutil.copytree(tiny_model_dir("gemma3"), d)
    raw = json.loads((d / "config.json").read_text())
    raw["final_logit_softcapping"] = 30.0
    (d / "config.json").write_text(json.dumps(raw))
    e = inspect(Found("softcap", d, "folder", "safetensors"))
    assert not e.supported and "final_logit_softcapping" in e.reason


def test_corrupt_files_are_refused_not_raised(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 8)
    e = inspect(Found("bad", bad, "folder", "gguf"))
    assert not e.supported and "corrupt" in e.reason
    d = tmp_path / "noweights"
    d.mkdir()
    (d / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    e = inspect(Found("noweights", d, "folder", "safetensors"))
    assert not e.supported and "safetensors" in e.reason
