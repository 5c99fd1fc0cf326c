"""The Triton kernels pass the real GPU compiler, not only the interpreter: each launch variant (the
model-dtype pool and the int8 / fp8 ones) is built down to a cubin for sm_80 and sm_90 (no GPU
needed) and ptxas' resource report is checked.
Runs in a subprocess because this test session imports the kernels in interpreter mode."""

import os
import re
import subprocess
import sys

from engine_proc.attention.triton_aot import LABEL_WIDTH
from tests.needs import require_triton

require_triton()  # a failure on Linux without it (a declared test dependency)


def test_kernels_compile_for_ampere_and_hopper_without_heavy_spills(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real, not from an earlier run's cache
    proc = subprocess.run(
        [sys.executable, "-m", "engine_proc.attention.triton_aot", "--quick", "--arch", "80,90"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines() if re.match(r"^(attention|write_kv) ", line)]
    # 7 variants (4 of them int8 / fp8 pools) x 2 architectures
    assert len(rows) == 14, proc.stdout
    assert sum("/int8 " in r for r in rows) == 4 and sum("/fp8 " in r for r in rows) == 4
    for row in rows:
        sm, warps, regs, spill, smem = row[LABEL_WIDTH:].split()[:5]
        assert int(regs) <= 255, row
        # A few bytes move with the Triton version; tiles that do not fit spill kilobytes
        # (float32 prefill at 64 rows x head_dim 128 spilled 43 KB before it got 32 rows).
        assert int(spill) < 1024, row
    assert "all variants compiled" in proc.stdout


def test_refuses_interpreter_mode():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "engine_proc.attention.triton_aot", "--quick"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "TRITON_INTERPRET=1" in proc.stdout


def test_rejects_bad_arch():
    proc = subprocess.run(
        [sys.executable, "-m", "engine_proc.attention.triton_aot", "--arch", "61"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "--arch" in proc.stderr and "75" in proc.stderr
