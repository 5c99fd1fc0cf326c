"""Memory a model needs at a chosen context and KV type, against the memory free now, with
LM Studio-style labels: "fits", "tight", "won't fit".

The KV part uses the engine's own sizing (engine_proc/core/kv_sizing.py, which LLMEngine sizes
its pool with): bytes per token for the KV element type, the layout of KV groups (the hybrid
one when the model has full and sliding-window layers: a request's sliding groups hold no more
blocks than their window spans), bytes per page, and the pages one request of `context` tokens
holds. The weights are counted as the engine holds them: every parameter in the model dtype (a
GGUF is dequantized on load). Not counted: 4-bit decode copies (decode_weights=int4; about half
a byte per linear weight), activations and the Python process itself; "auto" KV is taken as
the model dtype (the engine picks fp16 under a float32 model with int4 decode on AVX-512 bf16
CPUs, fewer bytes than estimated here)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from engine_proc.config import SUPPORTED_DTYPES
from engine_proc.core.kv_sizing import (
    KV_CACHE_DTYPES,
    block_bytes,
    engine_layout,
    kv_bytes_per_token,
    request_blocks,
)
from engine_proc.models.config import ModelConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
assert set(DTYPE_BYTES) == set(SUPPORTED_DTYPES)
FITS, TIGHT, WONT_FIT, UNKNOWN = "fits", "tight", "won't fit", "unknown"
FIT_LABELS = (FITS, TIGHT, WONT_FIT, UNKNOWN)
HEADROOM = 0.8  # "fits" when the need is at most this share of the free memory
DEFAULT_BLOCK_SIZE = 16  # EngineConfig.block_size


@dataclass(slots=True)
class Estimate:
    context: int  # tokens, capped at the model's context length
    kv_cache_dtype: str
    dtype: str
    kv_bytes_per_token: int  # every layer, as the engine logs it ("B/token")
    hybrid: bool  # sliding-window groups release blocks out of their window
    block_bytes: int  # one page of the pool
    kv_blocks: int  # pages one request of `context` tokens holds
    kv_bytes: int  # kv_blocks * block_bytes: a kv_cache_memory that fits one such request
    weights_bytes: int
    total_bytes: int
    available_bytes: int  # 0: unknown
    fit: str  # one of FIT_LABELS
    note: str = ""  # a combination the engine refuses

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def estimate(
    config: ModelConfig, params: int, context: int | None = None, kv_cache_dtype: str = "auto",
    dtype: str = "float32", hybrid_kv: bool = True, block_size: int = DEFAULT_BLOCK_SIZE,
    available: int | None = None,
) -> Estimate:  # fmt: skip
    """Weights + the KV of one request of `context` tokens (default: the model's context
    length) for this config; `available` bytes default to the memory free now."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {tuple(DTYPE_BYTES)}, got {dtype!r}")
    if context is not None and (isinstance(context, bool) or not isinstance(context, int)
                                or context < 1):  # fmt: skip
        raise ValueError(f"context must be a positive number of tokens, got {context!r}")
    c = config
    tokens = min(context or c.max_position_embeddings, c.max_position_embeddings)
    itemsize = DTYPE_BYTES[dtype]
    layout = engine_layout(c.layer_types, c.num_layers, c.sliding_window, hybrid_kv, tokens)
    page = block_bytes(kv_cache_dtype, layout, c.num_kv_heads, c.head_dim, itemsize, block_size)
    blocks = request_blocks(layout, tokens, block_size)
    note = ""
    if layout.is_hybrid and kv_cache_dtype == "fp8":
        note = ("kv_cache_dtype='fp8' with a hybrid KV cache is not supported by the engine; "
                "use another KV type")  # fmt: skip
    weights = params * itemsize
    kv = blocks * page
    free = available_memory() if available is None else available
    return Estimate(
        context=tokens, kv_cache_dtype=kv_cache_dtype, dtype=dtype,
        kv_bytes_per_token=kv_bytes_per_token(kv_cache_dtype, c.num_layers, c.num_kv_heads,
                                              c.head_dim, itemsize),
        hybrid=layout.is_hybrid, block_bytes=page, kv_blocks=blocks, kv_bytes=kv,
        weights_bytes=weights, total_bytes=weights + kv, available_bytes=free,
        fit=fit_label(weights + kv, free), note=note,
    )  # fmt: skip


def fit_label(need: int, available: int) -> str:
    if available <= 0:
        return UNKNOWN
    if need <= HEADROOM * available:
        return FITS
    return TIGHT if need <= available else WONT_FIT


def available_memory() -> int:
    """Bytes of memory free for a new process now (psutil, else /proc/meminfo MemAvailable);
    0 when neither can tell."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0
