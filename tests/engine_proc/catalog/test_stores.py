"""engine_proc/catalog/stores.py against each store's documented layout (stores_fixture.py) and
the environment variables each tool reads."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from engine_proc.catalog import stores
from tests.engine_proc.catalog.stores_fixture import HF_REVISION, env_for, make_home


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    root = tmp_path_factory.mktemp("catalog")
    return root, make_home(root)


def test_every_store_is_found_with_its_name(home):
    root, expected = home
    found = stores.discover([root / "my-models"], env=env_for(root))
    got = {f.name: f for f in found}
    assert {n: got[n].path for n in expected} == expected
    assert got["tiny-pub/Tiny-Llama-GGUF/tiny-llama-F32.gguf"].store == "lmstudio"
    assert got["tiny-org/tiny-llama"].store == "huggingface"
    assert got["tiny-org/tiny-llama"].format == "safetensors"
    assert got["tinyllama:latest"].store == "ollama"
    assert got["tinyllama:latest"].format == "gguf"
    assert got["tiny-org_Tiny-GGUF_tiny-q"].store == "llama.cpp"
    assert got["gpt2-tiny"].store == "folder"
    assert len(found) == len(expected)


def test_hf_cache_takes_the_snapshot_refs_main_names(home):
    root, _ = home
    cache = root / "home" / ".cache" / "huggingface" / "hub"
    (found,) = stores.huggingface(cache)
    assert found.path.name == HF_REVISION


def test_env_vars_move_the_stores(home, tmp_path):
    root, _ = home
    src = root / "home"
    shutil.copytree(src / ".cache" / "huggingface" / "hub", tmp_path / "hf" / "hub", symlinks=True)
    shutil.copytree(src / ".ollama" / "models", tmp_path / "ollama")
    shutil.copytree(src / ".cache" / "llama.cpp", tmp_path / "lc")
    empty_home = tmp_path / "empty"
    empty_home.mkdir()
    for env, store in (({"HF_HOME": str(tmp_path / "hf")}, "huggingface"),
                       ({"HF_HUB_CACHE": str(tmp_path / "hf" / "hub")}, "huggingface"),
                       ({"OLLAMA_MODELS": str(tmp_path / "ollama")}, "ollama"),
                       ({"LLAMA_CACHE": str(tmp_path / "lc")}, "llama.cpp")):  # fmt: skip
        found = stores.discover(env={"HOME": str(empty_home), **env})
        assert [f.store for f in found] == [store], env


def test_ollama_manifest_without_a_model_layer_or_blob_is_skipped(home, tmp_path):
    root, _ = home
    models = tmp_path / "ollama"
    shutil.copytree(root / "home" / ".ollama" / "models", models)
    for blob in (models / "blobs").iterdir():
        blob.unlink()
    assert stores.ollama(models) == []


def test_one_file_listed_once(home):
    root, expected = home
    lm = expected["tiny-pub/Tiny-Llama-GGUF/tiny-llama-F32.gguf"]
    found = stores.discover([lm, lm.parent], env=env_for(root))
    assert [f.path for f in found].count(lm) == 1
    assert stores.discover([root / "does-not-exist"], env={"HOME": str(root / "nowhere")}) == []
