"""The fused step's extension as the kernel tests take it: built for this CPU, and built for
Haswell (AVX2, FMA, F16C, no AVX-512) where this CPU has AVX-512, so the kernels an AVX-512
build leaves out (the AVX2 8-bit head, the AVX2 fallbacks beside the VNNI ones) are held to
their scalar twins and references on every x86 machine the suite runs on, not only on AVX2
ones."""

from __future__ import annotations

from types import ModuleType

import pytest

from engine_proc.executor import fused_build
from engine_proc.models.layers import cpu_flags

ARCHES = (fused_build.NATIVE_ARCH, "haswell")
AVX2_FLAGS = frozenset({"avx2", "fma", "f16c"})


def build(arch: str) -> ModuleType:
    why = fused_build.build_unavailable_reason()
    if why is not None:
        pytest.skip(f"the fused decode step {why}; the engine decodes eagerly")
    if arch != fused_build.NATIVE_ARCH:
        flags = cpu_flags()
        if not AVX2_FLAGS <= flags:
            pytest.skip("this CPU runs no AVX2 code")
        if "avx512f" not in flags:
            pytest.skip("the native build is the AVX2 build on this CPU")
    return fused_build.load_extension(arch)


def extension_fixture():
    """A module's `extension` fixture taking each build in turn (kernel tests only: the
    engine's own tests run the native build)."""

    @pytest.fixture(scope="module", params=ARCHES)
    def extension(request) -> ModuleType:
        return build(request.param)

    return extension
