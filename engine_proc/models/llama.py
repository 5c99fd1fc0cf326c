"""Our own forward pass for Llama-family models (Llama, Mistral without sliding window, Qwen2)
over a paged KV cache. Works on a flat batch: every sequence's new tokens laid end to end."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine_proc.attention.base import AttentionBackend, AttentionMetadata
from engine_proc.models.config import ModelConfig
from engine_proc.models.int4 import (
    GROUP_SIZE,
    MAX_ROWS,
    Int4Weight,
    int4_kernels_available,
    int4_matmul,
    quantize_int4,
)

DECODE_WEIGHTS = ("dense", "int4")


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    # float32 arithmetic in the same order as transformers, so float32 logits agree to the bit
    # as far as possible (greedy ties are decided by the last bits).
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    )
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":
        inv_freq = llama3_scale(inv_freq, scaling)
    elif kind not in (None, "default"):
        raise ValueError(f"rope_scaling type must be 'llama3' or absent, got {kind!r}")
    return inv_freq


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
    """cos/sin tables for every position up to the model's context, built once."""

    def __init__(self, config: ModelConfig, max_positions: int, device: torch.device) -> None:
        inv_freq = rope_inv_freq(config)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # full head_dim, as rotate_half wants
        self.cos = emb.cos().to(device)
        self.sin = emb.sin().to(device)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows of this step's positions, [T, 1, head_dim], gathered once per step."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [tokens, heads, head_dim]; rotate_half layout, the same float32 arithmetic as
        # transformers (x * cos + rotate_half(x) * sin), so float32 logits agree.
        xf = x if x.dtype == torch.float32 else x.float()
        x1, x2 = xf.chunk(2, dim=-1)
        out = xf * cos + torch.cat((-x2, x1), dim=-1) * sin
        return out if x.dtype == torch.float32 else out.to(x.dtype)


class LlamaLayer:
    def __init__(self, config: ModelConfig, w: dict[str, torch.Tensor], prefix: str) -> None:
        attn = f"{prefix}.self_attn"
        mlp = f"{prefix}.mlp"
        # One matmul for q/k/v and one for gate/up: fewer, larger GEMMs.
        self.qkv_weight = torch.cat(
            [w[f"{attn}.q_proj.weight"], w[f"{attn}.k_proj.weight"], w[f"{attn}.v_proj.weight"]]
        ).contiguous()
        self.qkv_bias = (
            torch.cat(
                [w[f"{attn}.q_proj.bias"], w[f"{attn}.k_proj.bias"], w[f"{attn}.v_proj.bias"]]
            )
            if f"{attn}.q_proj.bias" in w
            else None
        )
        self.o_weight = w[f"{attn}.o_proj.weight"].contiguous()
        self.gate_up_weight = torch.cat(
            [w[f"{mlp}.gate_proj.weight"], w[f"{mlp}.up_proj.weight"]]
        ).contiguous()
        self.down_weight = w[f"{mlp}.down_proj.weight"].contiguous()
        self.input_norm = w[f"{prefix}.input_layernorm.weight"]
        self.post_norm = w[f"{prefix}.post_attention_layernorm.weight"]
        # 4-bit copies for decode-sized products (see models/int4.py); None = dense only.
        self.qkv_int4: Int4Weight | None = None
        self.o_int4: Int4Weight | None = None
        self.gate_up_int4: Int4Weight | None = None
        self.down_int4: Int4Weight | None = None

    def int4_copies(self) -> tuple[Int4Weight | None, ...]:
        """qkv, o, gate_up and down 4-bit copies (None where there are none)."""
        return self.qkv_int4, self.o_int4, self.gate_up_int4, self.down_int4

    def pack_int4(self) -> None:
        self.qkv_int4 = quantize_int4(self.qkv_weight)
        self.o_int4 = quantize_int4(self.o_weight)
        self.gate_up_int4 = quantize_int4(self.gate_up_weight)
        self.down_int4 = quantize_int4(self.down_weight)


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
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def bf16_lm_head_rows(native_bf16: bool) -> int:
    """Up to how many rows the int4 mode's bf16 output-projection copy is used (float32 model):
    every decode-sized step with native bf16, otherwise only where the emulated product is fast."""
    return MAX_ROWS if native_bf16 else EMULATED_BF16_ROWS


# Float32 CPU products of prompt-sized steps run on oneDNN instead of torch's default BLAS (MKL):
# measured on a 2-core AVX-512 EPYC, oneDNN is 1.15-1.6x faster for such products (MKL takes a
# slower path on non-Intel CPUs). Float32 either way, summed in another order. oneDNN takes the
# largest multiple of this many rows (so it sees at most max_num_batched_tokens / 256 row
# counts); smaller steps (decode) and the rest of the rows stay on MKL, as in transformers.
ONEDNN_ROWS = 256


@functools.cache
def onednn_linear_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


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
      ``rows % ONEDNN_ROWS`` rows)."""

    def __init__(
        self, device: torch.device, dtype: torch.dtype, native_bf16: bool | None = None
    ) -> None:
        if native_bf16 is None:
            native_bf16 = cpu_has_native_bf16()
        self.upcast = dtype == torch.bfloat16 and device.type == "cpu" and not native_bf16
        self.onednn = (
            dtype == torch.float32 and device.type == "cpu" and onednn_linear_available()
        )

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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        # One fused op, bit-identical to transformers' x * rsqrt(mean(x^2) + eps) * weight in
        # float32 (tests/engine_proc/engine/test_hf_parity.py would see a last-bit difference in
        # greedy ties).
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def int4_unsupported_reason(config: ModelConfig, device: torch.device) -> str | None:
    """Why 4-bit decode weights cannot be used for this model here, or None when they can."""
    if device.type != "cpu":
        return f"runs on the CPU only (torch's int4 CPU kernel), the model is on {device}"
    if not int4_kernels_available():
        return f"needs torch's int4 CPU kernels, missing in torch {torch.__version__}"
    # torch packs groups of 32 along the input and needs outputs in multiples of 16.
    c = config
    for name, dim, multiple in (
        ("hidden_size", c.hidden_size, GROUP_SIZE),
        ("intermediate_size", c.intermediate_size, GROUP_SIZE),
        ("num_heads x head_dim", c.num_heads * c.head_dim, GROUP_SIZE),
        ("(num_heads + 2 x num_kv_heads) x head_dim", (c.num_heads + 2 * c.num_kv_heads)
         * c.head_dim, 16),
    ):  # fmt: skip
        if dim % multiple:
            return f"needs {name} divisible by {multiple}, got {dim}"
    return None


class LlamaModel:
    """Weights held as plain tensors; no nn.Module machinery on the hot path."""

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int,
        decode_weights: str = "dense",
        native_bf16: bool | None = None,
    ) -> None:
        """native_bf16: whether bf16 CPU products run natively (None: this CPU's flags, see
        cpu_has_native_bf16); it picks the arithmetic of bf16 products (see Linear and
        bf16_lm_head_rows), so tests force each branch with it."""
        if decode_weights not in DECODE_WEIGHTS:
            raise ValueError(
                f"decode_weights must be one of {DECODE_WEIGHTS}, got {decode_weights!r}"
            )
        self.config = config
        self.dtype = dtype
        self.device = device
        w = {k: v.to(device=device, dtype=dtype) for k, v in weights.items()}
        self.embed = w["model.embed_tokens.weight"]
        self.layers = [LlamaLayer(config, w, f"model.layers.{i}") for i in range(config.num_layers)]
        self.norm = w["model.norm.weight"]
        self.lm_head = self.embed if config.tie_word_embeddings else w["lm_head.weight"]
        self.rotary = RotaryEmbedding(config, max_positions, device)
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        self.native_bf16 = cpu_has_native_bf16() if native_bf16 is None else native_bf16
        self.linear = Linear(device, dtype, self.native_bf16)
        self.decode_weights = decode_weights
        self.lm_head_decode: torch.Tensor | None = None  # bf16 copy for decode (int4 mode)
        self.lm_head_decode_rows = 0
        # Logits of up to head_kernel_rows rows by a faster kernel (hidden -> float32 logits),
        # set by the fused decode step (engine_proc/executor/fused_decode.py); None: the paths
        # below.
        self.head_kernel: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.head_kernel_rows = 0
        if decode_weights == "int4":
            self._pack_int4()

    def _pack_int4(self) -> None:
        why = int4_unsupported_reason(self.config, self.device)
        if why is not None:
            raise ValueError(f"decode_weights='int4' {why}: use decode_weights='dense'")
        for layer in self.layers:
            layer.pack_int4()
        # The output projection (often the largest matrix: vocab x hidden) is kept in bfloat16,
        # not 4 bits: it holds the logits' precision, and bf16 already halves a float32 read.
        # Without native bf16 the CPU's bf16 product is fast for one or two rows only.
        if self.dtype == torch.float32:
            self.lm_head_decode = self.lm_head.to(torch.bfloat16)
            self.lm_head_decode_rows = bf16_lm_head_rows(self.native_bf16)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        cfg = self.config
        h = F.embedding(input_ids, self.embed)
        cos, sin = self.rotary.tables(positions)
        qk_heads = cfg.num_heads + cfg.num_kv_heads
        # 4-bit copies for decode steps only: a step with prompt tokens (however short) keeps
        # the dense weights, so the prefill, which picks a reply's first token, is the dense
        # model's (a short chat prompt alone once flipped it on the 4-bit weights).
        decode_step = meta.max_query_len == 1
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            q4 = layer.int4_copies() if decode_step else (None, None, None, None)
            x = rms_norm(h, layer.input_norm, cfg.rms_norm_eps)
            qkv = self.linear(x, layer.qkv_weight, layer.qkv_bias, q4[0])
            # One rotary pass over q and k together (they are adjacent columns of qkv).
            qk = qkv[:, : self.q_size + self.kv_size].view(-1, qk_heads, cfg.head_dim)
            qk = self.rotary.apply(qk, cos, sin)
            q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :]
            v = qkv[:, self.q_size + self.kv_size :].view(-1, cfg.num_kv_heads, cfg.head_dim)
            backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
            attn = backend.forward(q, k_cache, v_cache, meta, self.scale)
            h = h + self.linear(attn.reshape(-1, self.q_size), layer.o_weight, None, q4[1])
            x = rms_norm(h, layer.post_norm, cfg.rms_norm_eps)
            gate, up = self.linear(x, layer.gate_up_weight, None, q4[2]).chunk(2, -1)
            h = h + self.linear(F.silu(gate) * up, layer.down_weight, None, q4[3])
        return rms_norm(h, self.norm, cfg.rms_norm_eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.head_kernel is not None and hidden.shape[0] <= self.head_kernel_rows:
            return self.head_kernel(hidden)
        if self.lm_head_decode is not None and hidden.shape[0] <= self.lm_head_decode_rows:
            return F.linear(hidden.to(torch.bfloat16), self.lm_head_decode).float()
        return self.linear(hidden, self.lm_head).float()
