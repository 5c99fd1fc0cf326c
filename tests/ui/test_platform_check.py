"""The start-up check that names the missing X libraries (and their packages) before Qt aborts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ui.platform_check import platform_problem

PLUGIN = Path("/nowhere/libqxcb.so")
LDD_OUTPUT = """\tlinux-vdso.so.1 (0x00007ffd)
\tlibQt6XcbQpa.so.6 => /venv/PySide6/Qt/lib/libQt6XcbQpa.so.6 (0x00007f)
\tlibxcb-icccm.so.4 => not found
\tlibxcb-keysyms.so.1 => not found
\tlibxcb-icccm.so.4 => not found
"""


def _missing(output: str):
    return lambda path: list(dict.fromkeys(
        ln.split("=>")[0].strip() for ln in output.splitlines() if "not found" in ln))


def test_missing_libraries_are_named_with_their_packages() -> None:
    msg = platform_problem({"DISPLAY": ":0"}, _missing(LDD_OUTPUT), PLUGIN, lambda name: None)
    assert msg is not None
    assert "missing libxcb-icccm.so.4, libxcb-keysyms.so.1, libxcb-cursor.so.0" in msg
    assert "sudo apt install libxcb-icccm4 libxcb-keysyms1 libxcb-cursor0\n" in msg


def test_nothing_missing_means_no_problem() -> None:
    found = lambda name: f"lib{name}.so.0"  # noqa: E731
    assert platform_problem({"DISPLAY": ":0"}, _missing(""), PLUGIN, found) is None
    # the cursor library alone (loaded at run time, so ldd cannot see it)
    msg = platform_problem({"DISPLAY": ":0"}, _missing(""), PLUGIN, lambda name: None)
    assert msg is not None and "sudo apt install libxcb-cursor0\n" in msg


def test_no_display_and_other_platforms() -> None:
    none_missing = _missing("")
    msg = platform_problem({}, none_missing, PLUGIN, lambda name: None)
    assert msg is not None and "DISPLAY is not set" in msg and "xvfb-run" in msg
    assert platform_problem({"QT_QPA_PLATFORM": "offscreen"}, none_missing, PLUGIN) is None
    assert platform_problem({"WAYLAND_DISPLAY": "wayland-0"}, none_missing, PLUGIN) is None


def test_the_app_says_what_to_do_instead_of_aborting() -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM")}
    proc = subprocess.run([sys.executable, "-m", "app", "--demo"], capture_output=True,
                          text=True, env=env, timeout=120)  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert "kvscope: no display: DISPLAY is not set" in proc.stderr
