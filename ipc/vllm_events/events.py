"""KV cache events as a subscriber sees them once decoded, whatever the publisher's encoding
(vLLM's map or array form, SGLang's), with hashes as the publisher sent them (an int: vLLM's
default low 64 bits of the digest; or raw bytes).

Media are the publisher's own strings: vLLM "GPU" / "CPU" / "DISK" (None when it sent none),
SGLang "GPU" / "CPU_PINNED" / "DISK"; KVScope publishes GPU for its pool (the device its blocks
live on; "GPU" is what routers expect for the first tier), CPU for the host tier, DISK for disk.
"""

from __future__ import annotations

from dataclasses import dataclass, field

BlockHash = int | bytes

MEDIUM_GPU, MEDIUM_CPU, MEDIUM_DISK = "GPU", "CPU", "DISK"


@dataclass(slots=True, frozen=True)
class Stored:
    block_hashes: tuple[BlockHash, ...]  # one chain: each block's parent is the one before it
    parent_block_hash: BlockHash | None  # parent of block_hashes[0]; None: a first block
    token_ids: tuple[int, ...]  # len(block_hashes) * block_size tokens
    block_size: int
    medium: str | None = None
    group_idx: int = 0  # hybrid caches: the group of layers (vLLM's kv cache group)
    lora_id: int | None = None


@dataclass(slots=True, frozen=True)
class Removed:
    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None
    group_idx: int = 0


@dataclass(slots=True, frozen=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


@dataclass(slots=True)
class Batch:
    seq: int  # the frame's sequence number (8-byte big-endian on the wire)
    ts: float
    events: list[Event] = field(default_factory=list)
    dp_rank: int | None = None  # vLLM data_parallel_rank / SGLang attn_dp_rank
