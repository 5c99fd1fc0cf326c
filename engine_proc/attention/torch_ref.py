"""Pure-torch paged attention: the reference path on CPU and the oracle for the Triton kernels.

Decode tokens (query length 1) of all sequences are served by one batched call over K/V gathered
through the block tables; each prompt chunk gets its own call with a causal mask offset by its
cached context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine_proc.attention.base import AttentionMetadata


class TorchAttentionBackend:
    name = "torch"

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
        flat_k.index_copy_(0, slot_mapping, key)
        flat_v.index_copy_(0, slot_mapping, value)

    def forward(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        out = torch.empty_like(query)
        decode_rows: list[int] = []
        start = 0
        for s, (q_len, seq_len) in enumerate(
            zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)
        ):
            if q_len == 1:
                decode_rows.append(s)
            else:
                table = meta.block_tables[s]
                k, v = _gather(k_cache, v_cache, table, seq_len)
                out[start : start + q_len] = _attend(
                    query[start : start + q_len], k, v, seq_len, scale
                )
            start += q_len
        if decode_rows:
            self._decode(query, k_cache, v_cache, meta, scale, decode_rows, out)
        return out

    def _decode(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        rows: list[int],
        out: torch.Tensor,
    ) -> None:
        # One padded batch for all decode tokens: [B, H, 1, D] against [B, H_kv, S_max, D].
        block_size = k_cache.shape[1]
        seq_lens = [meta.seq_lens_cpu[s] for s in rows]
        max_len = max(seq_lens)
        num_blocks = -(-max_len // block_size)
        rows_t = torch.tensor(rows, device=query.device)
        tables = meta.block_tables[rows_t, :num_blocks].clamp(min=0)  # -1 padding masked below
        k = k_cache[tables].flatten(1, 2)[:, :max_len]  # [B, S, H_kv, D]
        v = v_cache[tables].flatten(1, 2)[:, :max_len]
        token_idx = meta.query_start_loc[rows_t + 1].long() - 1
        q = query[token_idx].unsqueeze(2)  # [B, H, 1, D]
        lens = torch.tensor(seq_lens, device=query.device)
        mask = torch.arange(max_len, device=query.device)[None, :] < lens[:, None]
        o = F.scaled_dot_product_attention(
            q,
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask[:, None, None, :],
            scale=scale,
            enable_gqa=True,
        )
        out[token_idx] = o.squeeze(2)


def _gather(
    k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    block_size = k_cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = table[:num_blocks]
    assert bool((blocks >= 0).all()), "block table has -1 inside the sequence's context"
    k = k_cache[blocks].flatten(0, 1)[:seq_len]
    v = v_cache[blocks].flatten(0, 1)[:seq_len]
    return k, v


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_len: int, scale: float
) -> torch.Tensor:
    # q: [Q, H, D] are the last Q positions of a sequence of seq_len; k, v: [S, H_kv, D].
    q_len = q.shape[0]
    context = seq_len - q_len
    q_pos = torch.arange(context, seq_len, device=q.device)
    mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=None if context == 0 else mask,
        is_causal=context == 0,
        scale=scale,
        enable_gqa=True,
    )
    return o.transpose(0, 1)
