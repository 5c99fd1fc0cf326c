"""Layers every architecture shares, as plain functions over tensors: rotary embeddings (default,
linear, Llama 3 and Phi-3's LongRoPE scaling; over all of each head or its first rotary_dim),
RMSNorm (Gemma's 1 + weight is folded into the weight at load), the
activations, and `Linear`, the
product that picks 4-bit, upcast or oneDNN arithmetic by the rows it is given."""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from engine_proc.models.config import ModelConfig
from engine_proc.models.int4 import MAX_ROWS, Int4Weight, int4_matmul


def rope_inv_freq(config: ModelConfig, theta: float | None = None,
                  scaled: bool = True) -> torch.Tensor:
    """Inverse frequencies for base ``theta`` (default: the config's); ``scaled``: with the
    config's rope scaling (Gemma 3's sliding layers use a plain local base)."""
    # float32 arithmetic in the same order as transformers, so float32 logits agree to the bit
    # as far as possible (greedy ties are decided by the last bits).
    dim = config.rope_dim
    base = config.rope_theta if theta is None else theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = (config.rope_scaling or {}) if scaled else {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "longrope":  # the short factors; RotaryEmbedding switches to the long ones
        inv_freq = longrope_inv_freq(config, scaling["short_factor"], base)
    elif kind == "llama3":
        inv_freq = llama3_scale(inv_freq, scaling)
    elif kind == "linear":  # positions divided by factor (Gemma 3's global layers at 4B+)
        inv_freq = inv_freq / scaling["factor"]
    elif kind not in (None, "default"):
        raise ValueError("rope_scaling type must be 'llama3', 'linear', 'longrope' or absent, "
                         f"got {kind!r}")  # fmt: skip
    return inv_freq


def longrope_inv_freq(config: ModelConfig, factors: tuple[float, ...],
                      base: float) -> torch.Tensor:  # fmt: skip
    """LongRoPE (Phi-3): each frequency divided by its own factor (transformers'
    _compute_longrope_parameters, the same float32 arithmetic)."""
    dim = config.rope_dim
    ext = torch.tensor(factors, dtype=torch.float32)
    if ext.numel() != dim // 2:
        raise ValueError(f"longrope factors: expected {dim // 2} (rotary_dim / 2), got "
                         f"{ext.numel()}")  # fmt: skip
    return 1.0 / (ext * base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def llama3_scale(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    # Same piecewise rule as Meta's reference: keep high frequencies, divide low ones by factor,
    # interpolate smoothly between.
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_len / low_freq_factor
    high_freq_wavelen = old_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """cos/sin tables for every position up to the model's context, built once.

    LongRoPE: two tables, both times attention_factor: rows [0, max_positions) with the short
    factors, then the same positions with the long ones (`long_offset` rows on). A sequence
    longer than original_max_position_embeddings reads the long rows at every position (the
    model runner adds long_offset to its positions; the scheduler recomputes a sequence that
    grows past that length), as transformers does: its forward picks one set by the call's
    largest position + 1, and Phi-3's generate() re-encodes the whole sequence with the long
    factors at the step that outgrows the original length. vLLM instead switches a whole batch
    to the long set when any of its positions exceeds it (keeping earlier K as they were);
    llama.cpp picks one set by its context size (n_ctx) for the whole run."""

    def __init__(self, config: ModelConfig, max_positions: int, device: torch.device,
                 theta: float | None = None, scaled: bool = True) -> None:
        inv_freq = rope_inv_freq(config, theta, scaled)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        scaling = (config.rope_scaling or {}) if scaled else {}
        mscale = 1.0
        self.long_offset: int | None = None
        if scaling.get("rope_type") == "longrope":
            base = config.rope_theta if theta is None else theta
            long = longrope_inv_freq(config, scaling["long_factor"], base)
            freqs = torch.cat([freqs, torch.outer(t, long)])
            self.long_offset = max_positions
            mscale = float(scaling["attention_factor"])
        emb = torch.cat((freqs, freqs), dim=-1)  # rotary_dim wide, as rotate_half wants
        self.cos = emb.cos().to(device)
        self.sin = emb.sin().to(device)
        if mscale != 1.0:  # transformers: cos() * attention_scaling, in float32
            self.cos, self.sin = self.cos * mscale, self.sin * mscale

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows of this step's positions, [T, 1, head_dim], gathered once per step."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [tokens, heads, head_dim]; rotate_half layout, the same float32 arithmetic as
        # transformers (x * cos + rotate_half(x) * sin), so float32 logits agree. Partial
        # rotary (cos narrower than the head): the rest of each head passes unrotated.
        xf = x if x.dtype == torch.float32 else x.float()
        rot = cos.shape[-1]
        xr = xf if rot == xf.shape[-1] else xf[..., :rot]
        x1, x2 = xr.chunk(2, dim=-1)
        out = xr * cos + torch.cat((-x2, x1), dim=-1) * sin
        if rot != xf.shape[-1]:
            out = torch.cat((out, xf[..., rot:]), dim=-1)
        return out if x.dtype == torch.float32 else out.to(x.dtype)


# Without native bf16, torch's bf16 CPU product is fast for this many rows at most (a
# matrix-vector product is memory-bound; larger ones run some 50x slower than float32).
EMULATED_BF16_ROWS = 2


@functools.cache
def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: without them torch emulates bf16 matmuls on the CPU, fast only for
    matrix-vector products (memory-bound) and some 50x slower than float32 otherwise.

    This is only the default of ``LlamaModel(native_bf16=None)`` / ``Linear``: the arithmetic
    of bf16 products depends on it (float32 upcast or not, how many rows use the bf16 output
    projection), so tests pass ``native_bf16`` (or replace this function) to run either branch
    on any CPU."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def bf16_lm_head_rows(native_bf16: bool) -> int:
    """Up to how many rows the int4 mode's bf16 output-projection copy is used (float32 model):
    every decode-sized step with native bf16, otherwise only where the emulated product is fast."""
    return MAX_ROWS if native_bf16 else EMULATED_BF16_ROWS


# Float32 CPU products of prompt-sized steps run on oneDNN instead of torch's default BLAS (MKL)
# on CPUs with AVX-512: measured on a 2-core AVX-512 EPYC (Zen 5), oneDNN is 1.15-1.6x faster
# for such products (MKL takes a slower path on non-Intel CPUs); on a 2-core AVX2 EPYC (Zen 1)
# it is 1.04-1.22x slower (the default model's four products at 1,000 rows: 45.0 vs 40.3 ms),
# so MKL keeps them there, as in transformers. Float32 either way, summed in another order.
# oneDNN takes the largest multiple of this many rows (so it sees at most
# max_num_batched_tokens / 256 row counts); smaller steps (decode) and the rest of the rows stay
# on MKL.
ONEDNN_ROWS = 256


@functools.cache
def onednn_linear_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_linear_preferred() -> bool:
    """oneDNN for float32 prompt products: where it is there and measured faster (AVX-512)."""
    return onednn_linear_available() and "avx512f" in cpu_flags()


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias by oneDNN's inner product (torch's own op, as inductor emits it)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class Linear:
    """F.linear, except that
    - a product of at most ``MAX_ROWS`` rows uses the 4-bit copy of the weight when there is one;
    - without native bf16 (``native_bf16=False``; default: this CPU's flags) a bf16 product of
      more than ``EMULATED_BF16_ROWS`` rows (prefill, batched decode) runs in float32 on upcast
      weights: the upcast reads the weights once, which costs far less than the emulated bf16
      GEMM would;
    - a float32 CPU product of at least ``ONEDNN_ROWS`` rows runs on oneDNN (but for its last
      ``rows % ONEDNN_ROWS`` rows) where ``onednn`` (default: onednn_linear_preferred())."""

    def __init__(
        self, device: torch.device, dtype: torch.dtype, native_bf16: bool | None = None,
        onednn: bool | None = None,
    ) -> None:  # fmt: skip
        if native_bf16 is None:
            native_bf16 = cpu_has_native_bf16()
        if onednn is None:
            onednn = onednn_linear_preferred()
        self.upcast = dtype == torch.bfloat16 and device.type == "cpu" and not native_bf16
        self.onednn = (onednn and dtype == torch.float32 and device.type == "cpu"
                       and onednn_linear_available())  # fmt: skip

    def __call__(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        packed: Int4Weight | None = None,
    ) -> torch.Tensor:
        if packed is not None and x.shape[0] <= MAX_ROWS:
            out = int4_matmul(x, packed)
            return out if bias is None else out + bias
        if self.upcast and x.shape[0] > EMULATED_BF16_ROWS:
            b = None if bias is None else bias.float()
            return F.linear(x.float(), weight.float(), b).to(x.dtype)
        rows = x.shape[0]
        if self.onednn and rows >= ONEDNN_ROWS:
            # oneDNN keeps memory for every row count it has seen (~0.65 MB each), so it only
            # ever sees multiples of ONEDNN_ROWS: the rest of the rows go to torch's BLAS.
            head = rows // ONEDNN_ROWS * ONEDNN_ROWS
            if head == rows:
                return onednn_linear(x, weight, bias)
            return torch.cat([onednn_linear(x[:head], weight, bias),
                              F.linear(x[head:], weight, bias)])  # fmt: skip
        return F.linear(x, weight, bias)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"silu": F.silu, "gelu_tanh": gelu_tanh}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        # One fused op, bit-identical to transformers' x * rsqrt(mean(x^2) + eps) * weight in
        # float32 (tests/engine_proc/engine/test_hf_parity.py would see a last-bit difference in
        # greedy ties).
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


