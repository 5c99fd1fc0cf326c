"""Pure-torch paged attention: the reference path on CPU and the oracle for the Triton kernels.

The pool may hold another float type than the model's (kv_cache_dtype "fp16" under a float32
model): writes round into it, reads widen back to the query's dtype.

Decode tokens (query length 1) of all sequences are served by one batched call over K/V gathered
through the block tables; each prompt chunk gets its own call with a causal mask offset by its
cached context. Index tensors and masks are built once per step (the plan) and reused by every
layer; a sliding-window layer (a query sees its own and the window - 1 positions before it) gets
a plan of its own with the window in its masks. Soft-capped attention (Gemma 2), which SDPA
cannot express, takes an explicit path (_attend_softcapped) over the same plans.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine_proc.attention.base import AttentionMetadata


@dataclass(slots=True)
class _Prefill:
    start: int  # first token of the chunk in the flat batch
    q_len: int
    blocks: torch.Tensor  # the sequence's blocks covering its context (a window's, sliding)
    seq_len: int
    mask: torch.Tensor | None  # None: a fresh prompt, plain causal
    first_key: int = 0  # position of the first key in `blocks` (a window's first block's)


@dataclass(slots=True)
class _Decode:
    token_idx: torch.Tensor | None  # [B] rows of the flat batch; None: every row, in order
    tables: torch.Tensor  # [B, blocks] with -1 clamped to 0 (masked below)
    max_len: int
    mask: torch.Tensor | None  # [B, 1, 1, keys]; None when every sequence sees max_len keys
    first_key: int = 0  # position of the first gathered key (the earliest window's block)


@dataclass(slots=True)
class _Plan:
    prefills: list[_Prefill]
    decode: _Decode | None


class TorchAttentionBackend:
    name = "torch"
    graph_safe = False  # plans each step from host lists (see AttentionBackend.graph_safe)

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        num_kv_heads, head_dim = k_cache.shape[-2:]
        flat_k = k_cache.view(-1, num_kv_heads, head_dim)
        flat_v = v_cache.view(-1, num_kv_heads, head_dim)
        valid = slot_mapping >= 0
        if not bool(valid.all()):
            slot_mapping, key, value = slot_mapping[valid], key[valid], value[valid]
        flat_k.index_copy_(0, slot_mapping, key.to(flat_k.dtype))
        flat_v.index_copy_(0, slot_mapping, value.to(flat_v.dtype))

    def forward(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        attend = _attend if softcap is None else functools.partial(_attend_softcapped,
                                                                   softcap=softcap)  # fmt: skip
        key = self.name if window is None else f"{self.name}/window{window}"
        plan = meta.backend_plan.get(key)
        if plan is None:
            plan = meta.backend_plan[key] = _make_plan(meta, k_cache.shape[1], query.device,
                                                       window)  # fmt: skip
        out = torch.empty_like(query)
        for p in plan.prefills:
            k = k_cache[p.blocks].flatten(0, 1)[: p.seq_len - p.first_key].to(query.dtype)
            v = v_cache[p.blocks].flatten(0, 1)[: p.seq_len - p.first_key].to(query.dtype)
            q = query[p.start : p.start + p.q_len]
            out[p.start : p.start + p.q_len] = attend(q, k, v, p.mask, scale)
        if plan.decode is not None:
            d = plan.decode
            b = d.tables.shape[0]
            # index_select over the flattened block ids: one gather per layer and tensor.
            k = k_cache.index_select(0, d.tables.view(-1)).view(b, -1, *k_cache.shape[2:])
            v = v_cache.index_select(0, d.tables.view(-1)).view(b, -1, *v_cache.shape[2:])
            keys = d.max_len - d.first_key
            k, v = k[:, :keys].to(query.dtype), v[:, :keys].to(query.dtype)
            q = query if d.token_idx is None else query[d.token_idx]
            if softcap is None:
                o = F.scaled_dot_product_attention(
                    q.unsqueeze(2),  # [B, H, 1, D]
                    k.transpose(1, 2),
                    v.transpose(1, 2),
                    attn_mask=d.mask,
                    scale=scale,
                    enable_gqa=True,
                )
            else:
                o = _softcapped(q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), d.mask,
                                scale, softcap)  # fmt: skip
            if d.token_idx is None:
                return o.squeeze(2)
            out[d.token_idx] = o.squeeze(2)
        return out


def _make_plan(meta: AttentionMetadata, block_size: int, device: torch.device,
               window: int | None = None) -> _Plan:  # fmt: skip
    prefills: list[_Prefill] = []
    decode_rows: list[int] = []
    start = 0
    for s, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
        if q_len == 1:
            decode_rows.append(s)
        else:
            context = seq_len - q_len
            # a sliding layer's chunk reads from its first query's window on: the blocks
            # before it may be released (-1 in the table), and are never read
            first = 0 if window is None else max(0, context - window + 1) // block_size
            blocks = meta.block_tables[s, first : -(-seq_len // block_size)]
            mask = None
            if context or (window is not None and window < seq_len):
                q_pos = torch.arange(context, seq_len, device=device)[:, None]
                k_pos = torch.arange(first * block_size, seq_len, device=device)[None, :]
                mask = k_pos <= q_pos
                if window is not None:
                    mask &= k_pos > q_pos - window
            prefills.append(_Prefill(start, q_len, blocks, seq_len, mask, first * block_size))
        start += q_len
    return _Plan(prefills, _decode_plan(meta, decode_rows, block_size, device, window))


def _decode_plan(
    meta: AttentionMetadata, rows: list[int], block_size: int, device: torch.device,
    window: int | None = None,
) -> _Decode | None:
    if not rows:
        return None
    seq_lens = [meta.seq_lens_cpu[s] for s in rows]
    max_len = max(seq_lens)
    rows_t = torch.tensor(rows, device=device)
    windowed = window is not None and window < max_len
    # sliding: from the block holding the earliest window's first key on (rows whose window
    # starts later mask the keys before it; released blocks, -1, are clamped and masked)
    first = min(max(0, n - window) for n in seq_lens) // block_size if windowed else 0
    tables = meta.block_tables[rows_t, first : -(-max_len // block_size)].clamp(min=0)
    mask = None  # equal lengths (a single stream, always): SDPA's unmasked kernel is faster
    if min(seq_lens) < max_len or windowed:
        lens = torch.tensor(seq_lens, device=device)[:, None]
        k_pos = torch.arange(first * block_size, max_len, device=device)[None, :]
        visible = k_pos < lens
        if windowed:
            visible &= k_pos >= lens - window
        mask = visible[:, None, None, :]
    all_rows = len(rows) == len(meta.query_lens_cpu) == sum(meta.query_lens_cpu)
    token_idx = None if all_rows else meta.query_start_loc[rows_t + 1].long() - 1
    return _Decode(token_idx, tables.contiguous(), max_len, mask, first * block_size)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    # q: [Q, H, D], the last Q positions of the sequence; k, v: [S, H_kv, D]. 4-D inputs: torch's
    # fused CPU attention kernel only takes those (3-D falls back to a far slower path).
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return o.squeeze(0).transpose(0, 1)


def _attend_softcapped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       mask: torch.Tensor | None, scale: float, softcap: float) -> torch.Tensor:
    """_attend with soft-capped scores; mask None: plain causal over the last Q positions."""
    if mask is None:
        q_pos = torch.arange(k.shape[0] - q.shape[0], k.shape[0], device=q.device)[:, None]
        mask = torch.arange(k.shape[0], device=q.device)[None, :] <= q_pos
    o = _softcapped(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                    v.transpose(0, 1).unsqueeze(0), mask, scale, softcap)  # fmt: skip
    return o.squeeze(0).transpose(0, 1)


def _softcapped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                scale: float, softcap: float) -> torch.Tensor:
    """q [B, H, Q, D], k/v [B, H_kv, S, D], mask broadcastable to [B, H, Q, S] (True = keep):
    softmax(softcap * tanh(q k^T * scale / softcap), masked) v, in transformers' eager order,
    the softmax in float32."""
    b, h, n, d = q.shape
    group = h // k.shape[1]
    # GQA without copying K/V: the query heads of a KV head side by side
    qg = q.reshape(b, k.shape[1], group * n, d)
    scores = torch.matmul(qg, k.transpose(-1, -2)).view(b, h, n, -1) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs.view(b, k.shape[1], group * n, -1), v)
    return out.view(b, h, n, d)
