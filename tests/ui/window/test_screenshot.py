"""`python -m app --screenshot OUT.png --load N` renders the window under load (its own tiny
engine process) and the PNG is not blank."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from PySide6.QtGui import QImage

from tests.ui.conftest import TINY_ENGINE_ARGS

pytestmark = pytest.mark.slow


def test_screenshot_under_load(tmp_path):
    out = tmp_path / "shot.png"
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", KVSCOPE_DATA_DIR=str(tmp_path / "d"))
    engine_args = " ".join([*TINY_ENGINE_ARGS, "--num-kv-blocks", "128"])
    proc = subprocess.run(
        [sys.executable, "-m", "app", "--screenshot", str(out), "--load", "16", "--settle", "3",
         "--engine-args", engine_args, "--timeout", "180"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "engine busy" in proc.stdout or "engine ready" in proc.stdout, proc.stdout
    img = QImage(str(out))
    assert not img.isNull() and img.width() >= 800 and img.height() >= 600
    # not blank: many distinct colours, and the block map area is not one flat colour
    small = img.scaled(160, 100)
    colours = {small.pixel(x, y) for x in range(160) for y in range(100)}
    assert len(colours) > 50
