"""app/models.py: `kvscope models` and `--model NAME` run the engine-side catalog as a subprocess
(the app imports no engine code) over stores laid out as each tool documents them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from app.models import catalog as models
from tests.engine_proc.catalog.stores_fixture import make_home, with_builtin

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return root, with_builtin(make_home(root))


@pytest.fixture()
def env(home, monkeypatch):
    root, expected = home
    monkeypatch.setenv("HOME", str(root / "home"))
    for var in ("HF_HOME", "HF_HUB_CACHE", "OLLAMA_MODELS", "LLAMA_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(ROOT)
    return root, expected


def test_command_checks_its_options():
    cmd = models.catalog_command(["/a"], 512, "int8", "bfloat16", resolve="x")
    assert cmd[:4] == [sys.executable, "-m", "engine_proc", "models"]
    assert cmd[4:] == ["--kv-cache-dtype", "int8", "--dtype", "bfloat16", "--dir", "/a",
                       "--context", "512", "--resolve", "x", "--json"]  # fmt: skip
    for kw, field in (({"kv_cache_dtype": "q4"}, "kv_cache_dtype"), ({"dtype": "int4"}, "dtype"),
                      ({"context": 0}, "context")):  # fmt: skip
        with pytest.raises(ValueError, match=field):
            models.catalog_command(**kw)


def test_list_models_reads_the_engines_json(env):
    root, expected = env
    data = models.list_models([str(root / "my-models")], context=128)
    assert {m["name"] for m in data["models"]} == set(expected)
    assert data["available_bytes"] > 0


def test_names_resolve_to_paths_and_paths_pass(env):
    root, expected = env
    assert models.resolve_model("tinyllama:latest") == str(expected["tinyllama:latest"])
    assert models.resolve_model("tiny-org/tiny-llama") == str(expected["tiny-org/tiny-llama"])
    path = str(expected["tiny-org_Tiny-GGUF_tiny-q"])
    assert models.resolve_model(path) == path
    assert models.resolve_model(None) is None
    with pytest.raises(ValueError, match="ambiguous.*tinyllama:latest"):
        models.resolve_model("tiny")
    with pytest.raises(ValueError, match="neither a path nor a listed model.*tinyllama:latest"):
        models.resolve_model("mistral-large")


def test_kvscope_models_prints_a_table(env):
    root, _ = env
    r = subprocess.run([sys.executable, "-m", "app", "models", "--dir", str(root / "my-models")],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "tinyllama:latest" in r.stdout and "refused:" in r.stdout
    r = subprocess.run([sys.executable, "-m", "app", "models", "--json"], capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert "tiny-org/tiny-llama" in {m["name"] for m in json.loads(r.stdout)["models"]}


def test_serve_refuses_an_unknown_name_listing_candidates(env, capsys):
    from app import serve

    assert serve.main(["--model", "no-such-model", "--port", "0"]) == serve.EXIT_BAD_OPTIONS
    err = capsys.readouterr().err
    assert "--model" in err and "tinyllama:latest" in err


def test_the_windows_model_option_takes_a_name(env):
    from app.__main__ import _resolve_model_arg
    from tests.ui.conftest import DictSettings

    root, expected = env
    settings = DictSettings({models.FOLDERS_KEY: [str(root / "my-models")]})
    assert _resolve_model_arg("gpt2-tiny", settings) == str(expected["gpt2-tiny"])
    assert _resolve_model_arg(None, settings) is None
    with pytest.raises(ValueError, match="ambiguous"):
        _resolve_model_arg("tiny-", settings)
