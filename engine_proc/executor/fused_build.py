"""Building the fused decode step's C++ extension (engine_proc/native/): compiled on first use
with the machine's C++ compiler (torch's cpp_extension, ``-O3 -march=native``) and cached under
``$KVSCOPE_CACHE_DIR/native`` (default ``~/.cache/kvscope/native``), keyed by its source,
torch's version and this CPU's flags, so a second start loads it in well under a second.
One process builds at a time, under a lock the OS drops with its process (build_lock.py):
a start that finds a build in progress waits for it (fused_lifecycle.py: eagerly, then switches).
What uses it: engine_proc/executor/fused_lifecycle.py."""

from __future__ import annotations

import argparse
import atexit
import hashlib
import logging
import shutil
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TypeVar

import torch

from engine_proc.executor import build_lock
from engine_proc.loading.loader import tokenizer_cache_dir
from engine_proc.models.layers import cpu_flags

logger = logging.getLogger(__name__)
T = TypeVar("T")

NATIVE = Path(__file__).parent.parent / "native"
SOURCE = NATIVE / "fused_decode.cpp"  # includes the headers beside it

NATIVE_ARCH = "native"  # -march: this CPU's instructions (tests also build for "haswell": AVX2)


def cflags(arch: str = NATIVE_ARCH) -> list[str]:
    """The compiler's flags for a build whose instructions are GCC's -march=arch."""
    return ["-O3", f"-march={arch}", "-fopenmp", "-fno-math-errno"]


LOCK_NAME = "kvscope.lock"  # ours, held by the building process (build_lock.py)
DONE_NAME = "built"  # written once a build finished: a start finding it loads at once
_lock = threading.Lock()
_loaded: dict[str, ModuleType] = {}


def build_unavailable_reason() -> str | None:
    """What this machine lacks to compile the extension (None: it can try)."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        return "needs a C++ compiler (c++ or g++ on PATH)"
    if shutil.which("ninja") is None:  # torch's cpp_extension builds with it
        return "needs ninja on PATH (pip install ninja)"
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        return "needs Python's C headers (Python.h, e.g. the python3-dev package)"
    return None


def read_sources() -> dict[str, str]:
    """The extension's source files (engine_proc/native), by name."""
    return {f.name: f.read_text(encoding="utf-8") for f in sorted(NATIVE.glob("*.[ch]*"))}


def build_key(sources: dict[str, str] | None = None, arch: str = NATIVE_ARCH) -> str:
    """What the compiled module depends on: source, torch, flags (-march=arch), and the CPU."""
    texts = list((sources or read_sources()).values())
    parts = [*texts, torch.__version__, " ".join(cflags(arch)), " ".join(sorted(cpu_flags()))]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def build_dir(key: str) -> Path:
    tokenizers = tokenizer_cache_dir()  # the kvscope cache root's tokenizer folder, or None
    if tokenizers is None:  # caching turned off: build in a temporary directory, gone at exit
        directory = tempfile.mkdtemp(prefix="kvscope-native-")
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
        return Path(directory)
    return tokenizers.parent / "native" / f"fused_decode_{key}"


def load_extension(arch: str = NATIVE_ARCH) -> ModuleType:
    """Compile (or load the cached build of) the extension; raises when it cannot be built.
    One process builds a directory at a time (build_lock.py); a start that finds another
    building waits for it, then loads its build (or builds itself when that one was killed).
    arch: GCC's -march; the engine's is this CPU's, tests build "haswell" too (the AVX2 kernels
    an AVX-512 build leaves out, run on the CPU at hand)."""
    sources = read_sources()
    key = build_key(sources, arch)
    with _lock:
        if key in _loaded:
            return _loaded[key]
        directory = build_dir(key)
        directory.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        module = locked_build(directory, lambda d: _compile(d, key, sources, arch))
        logger.info("fused decode step loaded in %.1f s (%s)", time.perf_counter() - t0, directory)
        _loaded[key] = module
        return module


def locked_build(directory: Path, build: Callable[[Path], T]) -> T:
    """``build(directory)`` under the directory's build lock, marked done when it returns."""
    with build_lock.holding(directory / LOCK_NAME):
        remove_leftover_torch_lock(directory)
        result = build(directory)
        (directory / DONE_NAME).touch()
        return result


def _compile(directory: Path, key: str, sources: dict[str, str], arch: str) -> ModuleType:
    from torch.utils import cpp_extension

    return cpp_extension.load(
        name=f"kvscope_fused_decode_{key}",
        sources=[str(staged_sources(directory, sources) / SOURCE.name)],
        extra_cflags=cflags(arch),
        extra_ldflags=["-fopenmp"],
        build_directory=str(directory),
        verbose=False,
    )


def staged_sources(directory: Path, sources: dict[str, str]) -> Path:
    """``sources`` (the texts ``directory``'s key was hashed from), written to ``directory``/src
    once. Compiled from there, a cached build loads without recompiling after the checkout
    moves or its files are touched: ninja would rebuild on a new source path or a newer source
    (measured: 31 s)."""
    staged = directory / "src"
    if (staged / SOURCE.name).exists():
        return staged
    incoming = Path(tempfile.mkdtemp(prefix="src-", dir=directory))
    for name, text in sources.items():
        (incoming / name).write_text(text, encoding="utf-8")
    try:
        incoming.rename(staged)
    except OSError:
        shutil.rmtree(incoming, ignore_errors=True)
        if not (staged / SOURCE.name).exists():  # not another process staging them first
            raise
    return staged


def remove_leftover_torch_lock(directory: Path) -> bool:
    """torch's cpp_extension waits for its `lock` file to go away before building, forever, and
    a build killed midway leaves it. Every build takes our lock first, so with our lock held a
    torch lock has no live holder: it is removed (True when one was)."""
    lock = directory / "lock"
    if not lock.exists():
        return False
    logger.warning("removing the lock file a killed build left: %s", lock)
    lock.unlink(missing_ok=True)
    return True


def is_built() -> bool:
    """Whether this machine has a finished build of the current source."""
    return build_state() == "built"


def build_state() -> str:
    """The build's state here: "built" (a finished build to load), "building" (another live
    process is building it now) or "absent"."""
    if tokenizer_cache_dir() is None:  # no cache: every start builds in its own directory
        return "absent"
    directory = build_dir(build_key())
    if (directory / DONE_NAME).exists() and any(directory.glob("*.so")):
        return "built"
    if directory.is_dir() and build_lock.held_elsewhere(directory / LOCK_NAME):
        return "building"
    return "absent"


def main() -> None:
    """python -m engine_proc.executor.fused_build: build (or load) the extension, print the time."""
    argparse.ArgumentParser(description=main.__doc__).parse_args()
    logging.basicConfig(level=logging.INFO)
    cached = is_built()
    t0 = time.perf_counter()
    load_extension()
    kind = "loaded from the cache" if cached else "compiled"
    print(f"fused decode step {kind} in {time.perf_counter() - t0:.1f} s: {build_dir(build_key())}")


if __name__ == "__main__":
    main()
