"""fp8 KV cache: float8 e4m3 (torch.float8_e4m3fn) values with one float32 scale per layer for
K and one for V, fixed once at engine start by a calibration forward.

Calibration (``calibrate_fp8_scales``): the model runs one fixed conversation
(``CALIBRATION_CHAT`` through the chat template, or ``CALIBRATION_TEXT`` for a model without
one) as a single prompt over a temporary model-dtype cache; each layer's largest |K| and |V| give
its scales. The input is fixed, not the first user prompt, so the scales are the same every
time the same model starts (same dtype and kind of device): blocks written to the disk tier by
one process, or handed over by another engine, decode with the scales they were written with.
A scale maps ``HEADROOM`` times the calibration's largest value to e4m3's largest (448), rounded
up to a power of two: later values up to that far beyond the calibration's stay in range (beyond
it they saturate; e4m3fn has no infinity), and dividing by a power of two is exact. Headroom
costs e4m3 almost nothing: its steps are relative (3 mantissa bits) down to 2**-6 of the scale.

Writes quantise ``clamp(x / scale, -448, 448)`` to e4m3 (round half to even, torch's cast);
reads dequantise only the blocks a step gathers, as the int8 format does (kv_quant.py).

Accuracy (``python -m engine_proc.bench.kv_quant_eval --kv-cache-dtype fp8``, default model, 2048
positions): mean KL divergence 1.15e-2 against the float32 cache, p99 9.0e-2, perplexity +1.5%,
top-1 agreement 93.6%; int8 measures 7.1e-4 / 4.4e-3 / +0.055%. Three mantissa bits round each
value by up to 6.25% (int8 per token: about 0.4% of the row's largest), and KL divergence grows
with the square of that error.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from engine_proc.attention.base import AttentionMetadata
from engine_proc.attention.torch_ref import TorchAttentionBackend

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
HEADROOM = 2.0
LAYER_SCALE_DTYPE = torch.float32
_MIN_AMAX = 1e-6  # a layer whose K (or V) is all zeros still gets a finite scale

CALIBRATION_CHAT: list[dict[str, str]] = [
    {"role": "system", "content": "You are a helpful assistant. Answer clearly and briefly."},
    {"role": "user", "content": "How does a paged KV cache work, and why does it help a server?"},
    {
        "role": "assistant",
        "content": (
            "An inference server keeps the keys and values of every token it has seen, so each "
            "new token only needs one step of attention. A paged cache stores them in fixed-size "
            "blocks, like an operating system's memory pages: a block table maps each sequence's "
            "positions to physical blocks, which need not be adjacent. Memory is then reserved "
            "16 tokens at a time instead of a whole context, 2-4x more requests fit in the same "
            "memory, and shared prefixes (a system prompt, few-shot examples) are stored once."
        ),
    },
    {"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."},
    {
        "role": "assistant",
        "content": (
            "def fib(n: int) -> int:\n    a, b = 0, 1\n    for _ in range(n):\n"
            "        a, b = b, a + b\n    return a\n\nFor example, fib(10) == 55."
        ),
    },
]
CALIBRATION_TEXT = "\n\n".join(m["content"] for m in CALIBRATION_CHAT)
# The default model's tokenizer makes 237 tokens of the chat; a character-level one many more.
# The cap bounds the start-up cost (about a second of CPU for the default model).
CALIBRATION_MAX_TOKENS = 256


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """x / scale, saturated to e4m3's range, as float8_e4m3fn (round half to even)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_fp8(
    q: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype
) -> torch.Tensor:
    return (q.float() * scale).to(dtype)


def scale_for(amax: float) -> float:
    """The power of two that maps HEADROOM x amax at or below FP8_MAX."""
    return 2.0 ** math.ceil(math.log2(max(amax, _MIN_AMAX) * HEADROOM / FP8_MAX))


class Fp8KV:
    """One layer's fp8 K (or V) cache [num_blocks, block_size, num_kv_heads, head_dim] and its
    0-d float32 scale; reads return dequantised tensors in ``dtype``."""

    __slots__ = ("data", "scale", "dtype")

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        assert data.dtype == FP8_DTYPE and scale.dim() == 0 and scale.dtype == LAYER_SCALE_DTYPE
        self.data = data
        self.scale = scale
        self.dtype = dtype

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    def __getitem__(self, index: object) -> torch.Tensor:
        return dequantize_fp8(self.data[index], self.scale, self.dtype)

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        assert dim == 0
        return dequantize_fp8(self.data.index_select(0, index), self.scale, self.dtype)

    def write(self, values: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        num_kv_heads, head_dim = self.data.shape[-2:]
        # torch has no CPU index_copy_ for float8: copy the codes as bytes.
        codes = quantize_fp8(values, self.scale).view(torch.uint8)
        self.data.view(torch.uint8).view(-1, num_kv_heads, head_dim).index_copy_(
            0, slot_mapping, codes
        )


def calibration_token_ids(tokenizer: Any) -> list[int]:
    """The fixed calibration prompt's ids: the chat through the model's template when it has
    one, else the same contents as plain text; at most CALIBRATION_MAX_TOKENS of them."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(CALIBRATION_CHAT, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(CALIBRATION_TEXT)["input_ids"]
    return list(ids[:CALIBRATION_MAX_TOKENS])


class _AmaxRecorder(TorchAttentionBackend):
    """The torch reference attention, noting each layer's largest |K| and |V| as written."""

    name = "torch-amax"

    def __init__(self) -> None:
        self.amax: list[tuple[float, float]] = []  # per layer, in call order

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:  # noqa: ANN001
        self.amax.append((key.abs().max().item(), value.abs().max().item()))
        super().write_kv(key, value, k_cache, v_cache, slot_mapping)


@torch.inference_mode()
def calibrate_fp8_scales(model: Any, token_ids: list[int], block_size: int = 16) -> torch.Tensor:
    """Per-layer K and V scales [num_layers, 2] (float32, on the model's device) from one
    forward of ``token_ids`` as a fresh prompt (``model`` is a models.llama.LlamaModel)."""
    n = len(token_ids)
    if n == 0:
        raise ValueError("calibration token_ids must not be empty")
    cfg, device = model.config, model.device
    num_blocks = -(-n // block_size)
    pool = torch.zeros(
        (cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim),
        dtype=model.dtype,
        device=device,
    )
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, device=device),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None],
        max_query_len=n,
        max_seq_len=n,
        query_lens_cpu=[n],
        seq_lens_cpu=[n],
    )
    recorder = _AmaxRecorder()
    ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
    model.forward(ids, torch.arange(n, device=device), [(c[0], c[1]) for c in pool], meta, recorder)
    assert len(recorder.amax) == cfg.num_layers
    scales = [[scale_for(k), scale_for(v)] for k, v in recorder.amax]
    return torch.tensor(scales, dtype=LAYER_SCALE_DTYPE, device=device)
