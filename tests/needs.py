"""What a test needs beyond what every test has, and what its absence means.

- triton is a declared test dependency (pyproject's `test` extra). Its wheels exist for Linux,
  so there a missing or broken triton FAILS the tests that need it (a green suite must mean the
  kernels ran). On other platforms, where triton cannot be installed, those tests skip, saying so.
- Without a GPU the Triton kernels run on CPU tensors through Triton's interpreter
  (tests/conftest.py sets TRITON_INTERPRET=1 before anything imports triton); with one they are
  compiled for it. Only tests that need a CUDA GPU skip on a machine without one.
"""

from __future__ import annotations

import sys
from types import ModuleType

import pytest


def require_triton() -> ModuleType:
    """triton, or a failure on Linux (a skip elsewhere) naming what is missing."""
    try:
        import triton
    except Exception as exc:  # ImportError, or a broken install that fails while importing
        if sys.platform.startswith("linux"):
            pytest.fail(
                f"triton is a test dependency (pip install -e '.[test]') and does not import: "
                f"{exc!r}",
                pytrace=False,
            )
        pytest.skip(f"triton has no wheels for {sys.platform}", allow_module_level=True)
    return triton


def triton_device() -> str:
    """The device the Triton kernels run on in this session: "cpu" through the interpreter on a
    machine without CUDA, "cuda" on one with it (skipped on GPUs too old for Triton)."""
    require_triton()
    import torch

    from engine_proc.attention import triton_backend as tb

    device = "cpu" if tb.kernels_interpreted() else "cuda"
    if device == "cuda" and torch.cuda.is_available() and not tb.is_triton_usable("cuda"):
        pytest.skip(
            "Triton needs a CUDA GPU of compute capability 7.5 or newer", allow_module_level=True
        )
    assert tb.is_triton_usable(device), (
        f"the Triton kernels cannot run on {device}: without CUDA, TRITON_INTERPRET=1 must be set "
        f"before engine_proc.attention.triton_backend is imported (tests/conftest.py does)"
    )
    return device


def interpreted_triton() -> None:
    """For tests of the kernels on CPU tensors (interpreter). On a CUDA machine the session's
    kernels are compiled for the GPU and cannot take CPU tensors: those tests skip there, and
    the `cuda`-marked tests cover the same paths on the GPU."""
    if triton_device() != "cpu":
        pytest.skip("CUDA present: this session's Triton kernels are compiled for the GPU")
