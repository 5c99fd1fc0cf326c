"""The architecture's rules as checks the suite runs: import-linter's contracts (pyproject.toml
`[tool.importlinter]`), no import circles, packages by concept, and ruff.

The contracts are shown to bite: a copy of the sources with one deliberate bad import per
contract makes `lint-imports` fail and name that contract."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("app", "engine_proc", "ipc", "ui")
LINT_IMPORTS = shutil.which("lint-imports") or "lint-imports"


def _lint_imports(cwd: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if pythonpath is not None:  # the copy's packages first, ahead of the editable install
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([LINT_IMPORTS, "--no-cache"], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip


def test_import_contracts_are_kept() -> None:
    proc = _lint_imports(REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout


# (file in the copy, the import appended to it, words of the contract it breaks); torch in ipc
# also reaches the desktop side through ipc (a second contract broken: counted below)
BAD_IMPORTS = [
    ("ipc/messages.py", "import torch", "ipc is shared by both processes"),
    ("ipc/endpoints.py", "import engine_proc.config", "ipc is shared by both processes"),
    ("engine_proc/config.py", "import PySide6", "the engine process imports no Qt"),
    ("ui/theme.py", "import engine_proc.config", "the desktop side (app, ui) never imports"),
    ("app/settings.py", "import torch", "the desktop side (app, ui) never imports"),
    ("engine_proc/core/block_pool.py", "import numpy", "engine_proc.core (block pool"),
    ("engine_proc/core/scheduler.py", "import engine_proc.engine.metrics", "engine_proc layers"),
    ("engine_proc/models/llama.py", "import engine_proc.executor.sampler", "engine_proc layers"),
    ("engine_proc/bench/common.py", "import engine_proc.server.wire", "engine_proc layers"),
    ("ui/kv/block_map.py", "import ui.window.status_bar", "ui layers"),
    ("app/api/errors.py", "import app.router.router", "app layers"),
]


@pytest.fixture(scope="module")
def source_copy(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("src")
    for pkg in PACKAGES:
        shutil.copytree(REPO / pkg, root / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    return root


@pytest.mark.parametrize(("path", "line", "contract"), BAD_IMPORTS,
                         ids=[f"{p}:{line}" for p, line, _ in BAD_IMPORTS])  # fmt: skip
def test_a_bad_import_breaks_its_contract(source_copy: Path, path: str, line: str,
                                          contract: str) -> None:  # fmt: skip
    target = source_copy / path
    original = target.read_text()
    try:
        target.write_text(original + f"\n{line}  # deliberately against the rules\n")
        proc = _lint_imports(source_copy, pythonpath=source_copy)
    finally:
        target.write_text(original)
    assert proc.returncode != 0, proc.stdout
    broken = proc.stdout.split("Broken contracts", 1)[-1]
    assert contract in broken, proc.stdout
    # torch in ipc also reaches the desktop side and engine_proc.core (its requests carry
    # SamplingParams, which carry ipc's StructuredOutput)
    expected = 3 if line == "import torch" and path.startswith("ipc/") else 1
    assert f"{expected} broken" in proc.stdout, proc.stdout  # that contract and no other


def _import_circles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    for start in sorted(graph.modules):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.find_modules_directly_imported_by(start))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    imported = sorted(graph.find_modules_directly_imported_by(child))
                    work.append((child, iter(imported)))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        circles.append(sorted(component))
    return circles


def test_the_import_graph_has_no_circles() -> None:
    """Every import counts, those under TYPE_CHECKING and inside functions included."""
    graph = grimp.build_graph(*PACKAGES)
    assert len(graph.modules) > 100
    assert _import_circles(graph) == []


def test_the_circle_finder_finds_circles() -> None:
    graph = grimp.ImportGraph()
    for module in ("a", "a.x", "a.y", "a.z", "a.w"):
        graph.add_module(module)
    graph.add_import(importer="a.x", imported="a.y")
    graph.add_import(importer="a.y", imported="a.z")
    graph.add_import(importer="a.z", imported="a.x")
    graph.add_import(importer="a.w", imported="a.x")
    assert _import_circles(graph) == [["a.x", "a.y", "a.z"]]


@pytest.mark.parametrize("package", ["engine_proc", "app", "ui"])
def test_top_levels_hold_entry_points_and_packages(package: str) -> None:
    """Families of modules live in packages of their own (engine_proc/core/, ui/window/, ...)."""
    modules = sorted(p.name for p in (REPO / package).glob("*.py"))
    assert len(modules) <= 8, modules


def test_ruff_is_clean() -> None:
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=REPO,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
