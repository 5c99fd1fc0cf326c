"""The attention backend interface: one call serves a flat batch that mixes decode tokens,
prompt chunks whose earlier context is already cached, and fresh prompts.

Layout of one layer's cache: k_cache, v_cache are [num_blocks, block_size, num_kv_heads, head_dim].
A slot is block_id * block_size + offset. Token i of sequence s sits at position
seq_lens[s] - query_len[s] + i and attends causally to positions 0..that position of its
sequence, read through block_tables[s] (padded with -1, which kernels must never read); in a
sliding-window layer only to the last `window` of those positions. With `softcap` (Gemma 2) the
scaled scores become softcap * tanh(scores / softcap) before the mask and softmax.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64; -1 = write nothing for this token
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32, context length including this step's tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with -1
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: list[int]  # host copies, so the reference path never syncs a device
    seq_lens_cpu: list[int]
    # What a backend derives from this metadata, computed at its first layer and reused by
    # every other layer of the step.
    backend_plan: dict[str, Any] = field(default_factory=dict)
    # A hybrid KV cache's sliding groups (engine_proc/core/kv_groups.py): their slot mappings
    # and block tables, group 1 first; the rest is this one's.
    groups: list[AttentionMetadata] = field(default_factory=list)

    def for_group(self, group: int) -> AttentionMetadata:
        return self if group == 0 else self.groups[group - 1]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


class AttentionBackend(Protocol):
    name: str
    # True when a call reads per-sequence data only from device tensors (never the *_cpu lists
    # or per-step host planning), so a CUDA graph replay with new buffer contents stays correct.
    graph_safe: bool

    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None: ...

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,  # a sliding-window layer's window (keys, itself included)
        softcap: float | None = None,  # attention logit soft-capping (Gemma 2)
    ) -> torch.Tensor: ...  # [num_tokens, num_heads, head_dim], dtype of query
