"""ipc.endpoints' loopback rule, and the boundaries of the wire: no pickle on either end, and
the desktop side and the terminal chat never load torch or the engine. No engine, no sockets."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ipc import endpoints as E

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "endpoint",
    [
        "tcp://127.0.0.1:5555",
        "tcp://127.0.0.1:*",
        "tcp://127.9.9.9:1",
        "tcp://[::1]:5555",
        "tcp://localhost:80",
        "inproc://x",
        "ipc://auto",
    ],
)
def test_loopback_endpoints_allowed(endpoint: str) -> None:
    assert E.is_loopback(endpoint)
    E.check_bind(endpoint, allow_remote=False, token=None)


@pytest.mark.parametrize(
    "endpoint",
    [
        "tcp://0.0.0.0:5555",
        "tcp://*:5555",
        "tcp://eth0:5555",
        "tcp://192.168.1.4:5555",
        "tcp://[::]:5555",
        "tcp://example.com:5555",
        "pgm://eth0;239.192.1.1:5555",
        "tcp://127.0.0.1;10.0.0.1:5555",
        "ipc:///tmp/kvscope.sock",
    ],
)
def test_remote_endpoints_refused_without_flag_and_token(endpoint: str) -> None:
    assert not E.is_loopback(endpoint)
    with pytest.raises(ValueError, match="allow-remote"):
        E.check_bind(endpoint, allow_remote=False, token="x" * 32)
    with pytest.raises(ValueError, match="token"):
        E.check_bind(endpoint, allow_remote=True, token=None)
    with pytest.raises(ValueError, match="token"):
        E.check_bind(endpoint, allow_remote=True, token="short")
    E.check_bind(endpoint, allow_remote=True, token="x" * 32)


def test_private_runtime_dir_makes_ipc_loopback() -> None:
    d = E.private_runtime_dir()
    try:
        assert E.is_loopback(f"ipc://{d}/engine.sock")
        ep, used = E.resolve_auto("ipc://auto", d, "engine.sock")
        assert ep == f"ipc://{d}/engine.sock" and used == d
    finally:
        Path(d).rmdir()


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_no_pickle_on_either_end_of_the_wire() -> None:
    """Messages are msgspec Structs, never pickles (which would run code from the socket). The
    torch and Qt boundaries are import-linter contracts (tests/test_architecture.py)."""
    for path in [*(REPO / "ipc").glob("*.py"), *(REPO / "engine_proc" / "server").glob("*.py"),
                 *(REPO / "engine_proc" / "kv_transfer").glob("*.py")]:  # fmt: skip
        assert "pickle" not in _imports(path), path


def test_app_chat_and_ipc_do_not_load_torch_or_the_engine() -> None:
    code = (
        "import sys, app.chat, ipc.client, ipc.protocol, ipc.endpoints\n"
        "banned = ('torch', 'engine_proc', 'PySide6', 'transformers')\n"
        "bad = [m for m in banned if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr


def test_gui_and_app_entry_points_do_not_load_torch_or_the_engine() -> None:
    code = (
        "import sys, app.__main__, app.bench.suite, app.supervisor, ui.window.main_window\n"
        "import ui.engine.demo\n"
        "banned = ('torch', 'triton', 'engine_proc', 'transformers')\n"
        "bad = [m for m in banned if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "QT_QPA_PLATFORM": "offscreen"}
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
