"""The PySide6 refcount workaround: a GUI's worth of void calls must not crash the interpreter."""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import sys
sys.path.insert(0, {root!r})
import ui  # applies the workaround
from PySide6.QtCore import QObject
o = QObject()
for _ in range(200_000):  # far more than None's natural reference count (~5,000)
    o.setObjectName("x")
print("alive", sys.getrefcount(None) > 1000)
"""


def test_many_void_calls_do_not_free_none():
    root = str(__import__("pathlib").Path(__file__).resolve().parents[2])
    out = subprocess.run([sys.executable, "-c", CHILD.format(root=root)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "alive True" in out.stdout
