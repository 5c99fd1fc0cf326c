"""engine_proc.attention.select_backend: auto picks what can run, forced names fail clearly."""

import logging

import pytest
import torch

from engine_proc.attention import select_backend
from tests.needs import interpreted_triton


def test_auto_is_torch_on_cpu_and_bad_names_are_listed():
    assert select_backend("auto", torch.device("cpu")).name == "torch"
    assert select_backend("torch", torch.device("cpu")).name == "torch"
    with pytest.raises(ValueError, match=r"one of \('auto', 'torch', 'triton'\), got 'flash'"):
        select_backend("flash", torch.device("cpu"))


def test_interpreted_kernels_serve_cpu_only(caplog):
    interpreted_triton()  # a failure without triton on Linux; a skip where CUDA compiles them
    assert select_backend("triton", torch.device("cpu")).name == "triton"
    # With the interpreter on, kernels cannot take CUDA tensors: auto falls back with a
    # warning, a forced triton says why.
    with caplog.at_level(logging.WARNING):
        assert select_backend("auto", torch.device("cuda")).name == "torch"
    assert "TRITON_INTERPRET=1" in caplog.text
    with pytest.raises(ValueError, match="triton' cannot run on cuda: TRITON_INTERPRET=1"):
        select_backend("triton", torch.device("cuda"))


def test_the_kv_cache_dtype_picks_the_quantised_variant_of_each_backend():
    cpu = torch.device("cpu")
    assert select_backend("auto", cpu, "int8").name == "torch-int8"
    assert select_backend("torch", cpu, "fp8").name == "torch-fp8"
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of .*'fp8'.*got 'fp4'"):
        select_backend("auto", cpu, "fp4")
    interpreted_triton()
    assert select_backend("triton", cpu, "fp8").name == "triton-fp8"
    assert select_backend("triton", cpu, "int8").name == "triton-int8"
