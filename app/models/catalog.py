"""`kvscope models`: the models on this machine (LM Studio, the Hugging Face cache, Ollama,
llama.cpp's cache, folders the user added), what the engine makes of each and a memory
estimate, as a table. The app imports no engine code: it runs `python -m engine_proc models`
(engine_proc/catalog/cli.py) with the same Python and reads its JSON. Also resolves a `--model`
value that is a listed name rather than a path (`kvscope --model tinyllama:latest`)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

KV_CACHE_DTYPES = ("auto", "fp32", "fp16", "int8", "fp8")  # engine_proc.config
DTYPES = ("float32", "bfloat16", "float16")
TIMEOUT_S = 120.0
FOLDERS_KEY = "models/folders"  # QSettings: folders the user added in the Models dialog


def catalog_command(
    dirs: list[str] | tuple[str, ...] = (), context: int | None = None,
    kv_cache_dtype: str = "auto", dtype: str = "float32", as_json: bool = True,
    resolve: str | None = None, python: str | None = None,
) -> list[str]:  # fmt: skip
    """The engine-side command line; ValueError naming a bad option."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if context is not None and (isinstance(context, bool) or not isinstance(context, int)
                                or context < 1):  # fmt: skip
        raise ValueError(f"context must be a positive number of tokens, got {context!r}")
    cmd = [python or sys.executable, "-m", "engine_proc", "models",
           "--kv-cache-dtype", kv_cache_dtype, "--dtype", dtype]  # fmt: skip
    for d in dirs:
        cmd += ["--dir", str(d)]
    if context is not None:
        cmd += ["--context", str(context)]
    if resolve is not None:
        cmd += ["--resolve", resolve]
    if as_json:
        cmd.append("--json")
    return cmd


def parse_catalog(stdout: str) -> dict:
    """The engine's JSON answer; ValueError with its error (or the unreadable output)."""
    try:
        data = json.loads(stdout.strip().splitlines()[-1] if stdout.strip() else "")
    except (json.JSONDecodeError, IndexError):
        raise ValueError(f"the model catalog answered no JSON: {stdout.strip()[:300]!r}") from None
    if not isinstance(data, dict):
        raise ValueError(f"the model catalog answered {type(data).__name__}, not an object")
    if "error" in data:
        raise ValueError(str(data["error"]))
    return data


def list_models(dirs: list[str] | tuple[str, ...] = (), **options) -> dict:
    """{"models": [...], "available_bytes": ...} from the engine-side catalog (blocking)."""
    r = subprocess.run(catalog_command(dirs, **options), capture_output=True, text=True,
                       timeout=TIMEOUT_S)  # fmt: skip
    return parse_catalog(r.stdout or r.stderr)


def looks_like_path(value: str) -> bool:
    p = Path(value).expanduser()
    return p.exists() or value.endswith(".gguf") or "/" in value and p.is_absolute()


def resolve_model(value: str | None, dirs: list[str] | tuple[str, ...] = ()) -> str | None:
    """A `--model` value as the engine takes it: None and existing paths as they are, a listed
    model's name as its path; ValueError listing the candidates for an unknown or ambiguous
    name."""
    if value is None or looks_like_path(value):
        return value
    r = subprocess.run(catalog_command(dirs, resolve=value), capture_output=True, text=True,
                       timeout=TIMEOUT_S)  # fmt: skip
    data = parse_catalog(r.stdout or r.stderr)
    return str(data["path"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvscope models", description=__doc__)
    p.add_argument("--json", action="store_true", help="the engine's JSON as it is")
    p.add_argument("--dir", action="append", default=[], metavar="PATH",
                   help="also search this folder (or .gguf file); repeatable")  # fmt: skip
    p.add_argument(
        "--context",
        type=int,
        default=None,
        metavar="N",
        help="tokens of context for the memory estimate (default: each model's own)",
    )
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--resolve", default=None, metavar="NAME", help="print one model's path")
    args = p.parse_args(argv)
    try:
        cmd = catalog_command(args.dir, args.context, args.kv_cache_dtype, args.dtype,
                              as_json=args.json, resolve=args.resolve)  # fmt: skip
    except ValueError as exc:
        print(f"kvscope models: {exc}", file=sys.stderr)
        return 2
    r = subprocess.run(cmd, timeout=TIMEOUT_S)  # output straight to the terminal
    return r.returncode
