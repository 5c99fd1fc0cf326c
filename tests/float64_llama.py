"""An independent float64 forward of a Llama checkpoint (transformers weight names), written from
the model's definition and sharing no code with engine_proc: the exact arithmetic of a model, or
that arithmetic with the bfloat16 roundings of the 4-bit decode path (engine_proc/models/int4.py)
put in at the same places, so tests compare the engine with what it should compute.

    ref = llama_forward(config, weights, ids, bf16_product_rows=rows_on_the_4bit_path)
    ref.logits, ref.hidden    # float64, [T, vocab] and [T, hidden] (final-norm output)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine_proc.models.config import ModelConfig


def bf16_round(x: torch.Tensor) -> torch.Tensor:
    """x rounded to the nearest bfloat16 value (8 significant bits), kept in x's dtype."""
    return x.to(torch.bfloat16).to(x.dtype)


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of bfloat16 at |x|: 2^(e - 8) for |x| in [2^(e-1), 2^e)."""
    _, exponent = torch.frexp(x.abs())
    return torch.ldexp(torch.ones_like(x), exponent - 8)


@dataclass(slots=True)
class Float64Forward:
    hidden: torch.Tensor  # [T, hidden_size] final-norm output
    logits: torch.Tensor  # [T, vocab_size]
    lm_head: torch.Tensor  # [vocab_size, hidden_size] as used for the logits (float64)


def q8_round(x: torch.Tensor) -> torch.Tensor:
    """x quantized per group of 32 along its last dimension to 8-bit codes, as values."""
    groups = x.reshape(*x.shape[:-1], -1, 32)
    step = groups.abs().amax(-1, keepdim=True) / 127
    codes = torch.round(groups / torch.where(step > 0, step, 1))
    return (codes * step).reshape(x.shape)


def _mask(rows: Sequence[bool] | None, n: int) -> torch.Tensor:
    if rows is None:
        return torch.zeros(n, 1, dtype=torch.bool)
    assert len(rows) == n, (len(rows), n)
    return torch.tensor(list(rows), dtype=torch.bool)[:, None]


def llama_forward(
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    ids: Sequence[int],
    *,
    bf16_product_rows: Sequence[bool] | None = None,
    bf16_head_rows: Sequence[bool] | None = None,
    bf16_product_outputs: bool = True,
    q8_mlp_rows: Sequence[bool] | None = None,
    q8_attention_rows: Sequence[bool] | None = None,
    q8_head_rows: Sequence[bool] | None = None,
    kv_transform: Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    | None = None,
) -> Float64Forward:
    """One causal pass over ``ids`` (positions 0..T-1) in float64.

    bf16_product_rows[t]: token t's linear products take bfloat16-rounded inputs and give
    bfloat16-rounded outputs (unrounded with ``bf16_product_outputs=False``), the weights used
    as given (torch's int4 kernel on weights whose 4-bit copy is lossless). bf16_head_rows[t]:
    token t's logits are the bfloat16-rounded product of its bfloat16-rounded hidden state and
    the bfloat16-rounded output projection. q8_mlp_rows[t]: token t's MLP products take inputs
    quantized per group of 32 to 8 bits (step max|x| / 127, nearest, ties to even), as the
    kernels of wide fused steps (engine_proc/native/int4_q8_kernels.h); q8_attention_rows[t]:
    the attention's two products (q, k, v and o) too; q8_head_rows[t]: the output projection's
    input too (decode_activations="int8").
    kv_transform(layer, k, v) -> (k, v): what a quantised KV cache stores of each layer's K
    (after rotary) and V, [T, num_kv_heads, head_dim], e.g. a quantise-dequantise round trip.
    Everything else is exact (to float64)."""
    c = config
    n = len(ids)
    w = {k: v.detach().to(torch.float64) for k, v in weights.items()}
    rounded = _mask(bf16_product_rows, n)
    q8_mlp, q8_attention = _mask(q8_mlp_rows, n), _mask(q8_attention_rows, n)

    def linear(x: torch.Tensor, name: str) -> torch.Tensor:
        x = torch.where(rounded, bf16_round(x), x)
        x = torch.where(q8_mlp if ".mlp." in name else q8_attention, q8_round(x), x)
        y = x @ w[name].t()
        bias = name.removesuffix(".weight") + ".bias"
        if bf16_product_outputs:
            y = torch.where(rounded, bf16_round(y), y)
        return y + w[bias] if bias in w else y

    def rms_norm(x: torch.Tensor, name: str) -> torch.Tensor:
        return w[name] * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps)

    half = torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim
    angles = torch.outer(torch.arange(n, dtype=torch.float64), c.rope_theta**-half)
    cos = torch.cat([angles.cos()] * 2, -1)[:, None]
    sin = torch.cat([angles.sin()] * 2, -1)[:, None]

    def rope(x: torch.Tensor) -> torch.Tensor:  # rotate_half layout
        x1, x2 = x.chunk(2, -1)
        return x * cos + torch.cat([-x2, x1], -1) * sin

    causal = torch.ones(n, n, dtype=torch.bool).tril()
    group = c.num_heads // c.num_kv_heads
    h = w["model.embed_tokens.weight"][torch.tensor(list(ids))]
    for i in range(c.num_layers):
        p = f"model.layers.{i}"
        x = rms_norm(h, f"{p}.input_layernorm.weight")
        q = rope(linear(x, f"{p}.self_attn.q_proj.weight").view(n, c.num_heads, c.head_dim))
        k = rope(linear(x, f"{p}.self_attn.k_proj.weight").view(n, c.num_kv_heads, c.head_dim))
        v = linear(x, f"{p}.self_attn.v_proj.weight").view(n, c.num_kv_heads, c.head_dim)
        if kv_transform is not None:
            k, v = kv_transform(i, k, v)
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(c.head_dim)
        probs = scores.masked_fill(~causal, -math.inf).softmax(-1)
        attn = torch.einsum("hts,shd->thd", probs, v).reshape(n, -1)
        h = h + linear(attn, f"{p}.self_attn.o_proj.weight")
        x = rms_norm(h, f"{p}.post_attention_layernorm.weight")
        gate = linear(x, f"{p}.mlp.gate_proj.weight")
        up = linear(x, f"{p}.mlp.up_proj.weight")
        h = h + linear(torch.nn.functional.silu(gate) * up, f"{p}.mlp.down_proj.weight")
    h = rms_norm(h, "model.norm.weight")
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    in_bf16 = _mask(bf16_head_rows, n)
    exact = torch.where(_mask(q8_head_rows, n), q8_round(h), h) @ head.t()
    logits = torch.where(in_bf16, bf16_round(bf16_round(h) @ bf16_round(head).t()), exact)
    return Float64Forward(h, logits, head)
