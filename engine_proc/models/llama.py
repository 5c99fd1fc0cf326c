"""Our own forward pass for the decoder families (engine_proc/models/registry.py: Llama,
Mistral, Qwen2, Qwen3, Phi-3, Gemma 2, Gemma 3, and with routed experts Qwen3-MoE and Mixtral)
over a paged KV cache, over the shared layers of engine_proc/models/layers.py (routed experts:
engine_proc/models/moe.py). Works on a flat batch: every sequence's new tokens laid end to
end. What the families differ in is in ModelConfig (q/k norms, sliding-window layers and their
rotary base, sandwich norms, scaled embeddings, the MLP's activation, soft-capping, partial
rotary, routed experts)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine_proc.attention.base import AttentionBackend, AttentionMetadata
from engine_proc.models import layers
from engine_proc.models.config import ModelConfig
from engine_proc.models.int4 import (
    GROUP_SIZE,
    Int4Weight,
    int4_kernels_available,
    quantize_int4,
)
from engine_proc.models.layers import (
    ACTIVATIONS,
    Linear,
    RotaryEmbedding,
    bf16_lm_head_rows,
    rms_norm,
)
from engine_proc.models.moe import RoutedExperts, moe_mlp

DECODE_WEIGHTS = ("dense", "int4")


class LlamaLayer:
    """One decoder layer's weights. q/k/v and gate/up are concatenated: fewer, larger GEMMs."""

    def __init__(self, config: ModelConfig, w: dict[str, torch.Tensor], prefix: str,
                 index: int) -> None:  # fmt: skip
        attn = f"{prefix}.self_attn"
        mlp = f"{prefix}.mlp"
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
        # routed experts in place of the MLP (Qwen3-MoE, Mixtral); None: the dense MLP below
        self.experts: RoutedExperts | None = None
        if config.layer_has_experts(index):
            self.experts = RoutedExperts(
                w[f"{mlp}.gate.weight"].contiguous(), w[f"{mlp}.experts.gate_up_proj"].contiguous(),
                w[f"{mlp}.experts.down_proj"].contiguous(), config.num_experts_per_tok,
                config.norm_topk_prob)  # fmt: skip
        else:
            self.gate_up_weight = torch.cat(
                [w[f"{mlp}.gate_proj.weight"], w[f"{mlp}.up_proj.weight"]]
            ).contiguous()
            self.down_weight = w[f"{mlp}.down_proj.weight"].contiguous()
        self.input_norm = w[f"{prefix}.input_layernorm.weight"]
        # Llama's post_attention_layernorm is the norm before the MLP; Gemma's sandwich puts
        # one after attention (its post_attention_layernorm) and two around the MLP.
        self.attn_out_norm: torch.Tensor | None = None
        self.mlp_out_norm: torch.Tensor | None = None
        if config.sandwich_norms:
            self.attn_out_norm = w[f"{prefix}.post_attention_layernorm.weight"]
            self.post_norm = w[f"{prefix}.pre_feedforward_layernorm.weight"]
            self.mlp_out_norm = w[f"{prefix}.post_feedforward_layernorm.weight"]
        else:
            self.post_norm = w[f"{prefix}.post_attention_layernorm.weight"]
        self.q_norm = w.get(f"{attn}.q_norm.weight") if config.qk_norm else None
        self.k_norm = w.get(f"{attn}.k_norm.weight") if config.qk_norm else None
        self.window = config.layer_window(index)  # None: full attention
        self.kv_group = 0  # its group in a hybrid KV cache (set by the model runner)
        self.kv_slot = index  # its slot in the KV cache's pages (set by the model runner)
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
        if self.experts is not None:
            self.experts.pack_int4()  # each expert's own 4-bit copies
        else:
            self.gate_up_int4 = quantize_int4(self.gate_up_weight)
            self.down_int4 = quantize_int4(self.down_weight)


def int4_unsupported_reason(config: ModelConfig, device: torch.device) -> str | None:
    """Why 4-bit decode weights cannot be used for this model here, or None when they can."""
    if device.type != "cpu":
        return f"runs on the CPU only (torch's int4 CPU kernel), the model is on {device}"
    if not int4_kernels_available():
        return f"needs torch's int4 CPU kernels, missing in torch {torch.__version__}"
    # torch packs groups of 32 along the input and needs outputs in multiples of 16.
    c = config
    dense_mlps = any(not c.layer_has_experts(i) for i in range(c.num_layers))
    for name, dim, multiple in (
        ("hidden_size", c.hidden_size, GROUP_SIZE),
        # the dense MLPs' width, each expert's (quantized one by one)
        ("intermediate_size", c.intermediate_size if dense_mlps else 0, GROUP_SIZE),
        ("moe_intermediate_size", c.moe_intermediate_size, GROUP_SIZE),
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
        self.layers = [LlamaLayer(config, w, f"model.layers.{i}", i)
                       for i in range(config.num_layers)]  # fmt: skip
        self.norm = w["model.norm.weight"]
        self.lm_head = self.embed if config.tie_word_embeddings else w["lm_head.weight"]
        self.rotary = RotaryEmbedding(config, max_positions, device)
        # Gemma 3's sliding layers rotate with their own base and without the global scaling.
        self.local_rotary = (
            RotaryEmbedding(config, max_positions, device, config.rope_local_theta, scaled=False)
            if config.rope_local_theta is not None else None)  # fmt: skip
        # Gemma multiplies embeddings by sqrt(hidden) rounded to the model's dtype.
        self.embed_scale = (None if config.embed_scale is None
                            else torch.tensor(config.embed_scale, dtype=dtype, device=device))
        self.act = ACTIVATIONS[config.hidden_act]
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.query_scale or config.head_dim**-0.5
        self.native_bf16 = layers.cpu_has_native_bf16() if native_bf16 is None else native_bf16
        self.linear = Linear(device, dtype, self.native_bf16)
        self.decode_weights = decode_weights
        self.lm_head_decode: torch.Tensor | None = None  # bf16 copy for decode (int4 mode)
        self.lm_head_decode_rows = 0
        # Logits of up to head_kernel_rows rows by a faster kernel (hidden -> float32 logits),
        # set by the fused decode step (engine_proc/executor/fused_decode.py); None: the paths
        # below.
        self.head_kernel: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.head_kernel_rows = 0
        # Tokens routed to each expert of each layer, summed over every forward since load (or
        # since a caller zeroed it); rows of dense layers stay 0. [layers, experts], int64.
        self.expert_counts: torch.Tensor | None = (
            torch.zeros(config.num_layers, config.num_experts, dtype=torch.int64, device=device)
            if config.has_experts else None)  # fmt: skip
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
        if self.embed_scale is not None:
            h = h * self.embed_scale
        tables = self.rotary.tables(positions)
        local = self.local_rotary.tables(positions) if self.local_rotary is not None else tables
        # 4-bit copies for decode steps only: a step with prompt tokens (however short) keeps
        # the dense weights, so the prefill, which picks a reply's first token, is the dense
        # model's (a short chat prompt alone once flipped it on the 4-bit weights).
        decode_step = meta.max_query_len == 1
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            q4 = layer.int4_copies() if decode_step else (None, None, None, None)
            x = rms_norm(h, layer.input_norm, cfg.rms_norm_eps)
            qkv = self.linear(x, layer.qkv_weight, layer.qkv_bias, q4[0])
            q, k, v = self._rotated_qkv(layer, qkv, *(tables if layer.window is None else local))
            layer_meta = meta.for_group(layer.kv_group)
            backend.write_kv(k, v, k_cache, v_cache, layer_meta.slot_mapping)
            if cfg.attn_logit_softcap is None:
                attn = backend.forward(q, k_cache, v_cache, layer_meta, self.scale, layer.window)
            else:  # Gemma 2
                attn = backend.forward(q, k_cache, v_cache, layer_meta, self.scale, layer.window,
                                       softcap=cfg.attn_logit_softcap)  # fmt: skip
            out = self.linear(attn.reshape(-1, self.q_size), layer.o_weight, None, q4[1])
            if layer.attn_out_norm is not None:
                out = rms_norm(out, layer.attn_out_norm, cfg.rms_norm_eps)
            h = h + out
            x = rms_norm(h, layer.post_norm, cfg.rms_norm_eps)
            if layer.experts is not None:
                counts = self.expert_counts[i] if self.expert_counts is not None else None
                out = moe_mlp(x, layer.experts, self.act, self.linear, counts, decode_step)
            else:
                gate, up = self.linear(x, layer.gate_up_weight, None, q4[2]).chunk(2, -1)
                out = self.linear(self.act(gate) * up, layer.down_weight, None, q4[3])
            if layer.mlp_out_norm is not None:
                out = rms_norm(out, layer.mlp_out_norm, cfg.rms_norm_eps)
            h = h + out
        return rms_norm(h, self.norm, cfg.rms_norm_eps)

    def _rotated_qkv(self, layer: LlamaLayer, qkv: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg = self.config
        v = qkv[:, self.q_size + self.kv_size :].view(-1, cfg.num_kv_heads, cfg.head_dim)
        if layer.q_norm is None:
            # One rotary pass over q and k together (they are adjacent columns of qkv).
            qk = qkv[:, : self.q_size + self.kv_size].view(-1, cfg.num_heads + cfg.num_kv_heads,
                                                           cfg.head_dim)  # fmt: skip
            qk = self.rotary.apply(qk, cos, sin)
            return qk[:, : cfg.num_heads], qk[:, cfg.num_heads :], v
        # Qwen3 / Gemma 3: each head's q and k RMS-normalised before rotary.
        q = qkv[:, : self.q_size].view(-1, cfg.num_heads, cfg.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(-1, cfg.num_kv_heads,
                                                                    cfg.head_dim)  # fmt: skip
        q = rms_norm(q, layer.q_norm, cfg.rms_norm_eps)
        k = rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
        return self.rotary.apply(q, cos, sin), self.rotary.apply(k, cos, sin), v

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.head_kernel is not None and hidden.shape[0] <= self.head_kernel_rows:
            logits = self.head_kernel(hidden)
        elif self.lm_head_decode is not None and hidden.shape[0] <= self.lm_head_decode_rows:
            logits = F.linear(hidden.to(torch.bfloat16), self.lm_head_decode).float()
        else:
            logits = self.linear(hidden, self.lm_head).float()
        cap = self.config.final_logit_softcap
        if cap is not None:  # Gemma 2: cap * tanh(logits / cap)
            logits = torch.tanh(logits / cap) * cap
        return logits
