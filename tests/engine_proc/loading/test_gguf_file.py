"""engine_proc/loading/gguf_file.py: torch dequantization of llama.cpp block formats, bit for bit
what gguf.quants (llama.cpp's own Python reference) gives, on random data and on the default
GGUF."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from engine_proc.loading.gguf_file import _TORCH_DEQUANT, GgufFile, GgufTensor, dequantize
from engine_proc.loading.loader import default_model_path

T = gguf.GGMLQuantizationType


def _reference(t: GgufTensor) -> torch.Tensor:
    out = gguf_dequantize(t.data, T(t.ggml_type))
    return torch.from_numpy(np.array(out, np.float32).reshape(tuple(reversed(t.shape))))


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0, T.F16, T.BF16, T.F32])
def test_random_tensors_match_gguf_bit_for_bit(qtype):
    assert qtype.value in _TORCH_DEQUANT
    rng = np.random.default_rng(qtype.value)
    rows, cols = 6, 96
    values = (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 3, (rows, 1))).astype(
        np.float32
    )
    data = np.asarray(gguf_quantize(values, qtype)).view(np.uint8).reshape(rows, -1)
    t = GgufTensor("w", (cols, rows), qtype.value, data)
    got = dequantize(t)
    assert got.dtype == torch.float32 and got.shape == (rows, cols)
    assert torch.equal(got, _reference(t))


def test_other_formats_fall_back_to_gguf():
    rng = np.random.default_rng(0)
    values = rng.standard_normal((2, 256)).astype(np.float32)
    data = np.asarray(gguf_quantize(values, T.Q5_0)).view(np.uint8).reshape(2, -1)
    t = GgufTensor("w", (256, 2), T.Q5_0.value, data)
    assert T.Q5_0.value not in _TORCH_DEQUANT
    assert torch.equal(dequantize(t), _reference(t))


def test_every_tensor_of_the_default_gguf_matches_gguf():
    f = GgufFile(default_model_path())
    seen = set()
    for t in f.tensors.values():
        seen.add(T(t.ggml_type).name)
        assert torch.equal(dequantize(t), _reference(t)), t.name
    assert {"Q4_1", "F32"} <= seen
