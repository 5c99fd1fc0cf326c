"""Where a block lives, from the publisher's own medium string, in three tiers the views draw:
the device (the GPU's KV cache), host memory, storage (disk, a shared or remote pool).

vLLM sends "GPU", "CPU" and "STORAGE" (None from versions without the field: the GPU, its only
tier then); SGLang "GPU", "CPU_PINNED", "DISK", "EXTERNAL" (early HiCache builds: "CPU_TIER1",
"CPU_TIER2"); KVScope "GPU", "CPU", "DISK". A medium nobody named here is a lower tier: a new
offload target is likelier than a new device.
"""

from __future__ import annotations

from ipc.vllm_events.events import MEDIUM_GPU

DEVICE, HOST, STORAGE = "device", "host", "storage"

_TIERS = {
    "GPU": DEVICE, "CUDA": DEVICE, "DEVICE": DEVICE, "HBM": DEVICE,
    "CPU": HOST, "CPU_PINNED": HOST, "CPU_TIER1": HOST, "HOST": HOST,
    "DISK": STORAGE, "STORAGE": STORAGE, "CPU_TIER2": STORAGE, "EXTERNAL": STORAGE,
}  # fmt: skip


def medium_name(medium: str | None) -> str:
    """The medium a tree records: the publisher's string, GPU when it sent none."""
    return medium or MEDIUM_GPU


def tier_of(medium: str) -> str:
    return _TIERS.get(medium.upper(), STORAGE)


def top_tier(media: frozenset[str] | set[str]) -> str:
    """The fastest tier holding a block: where a request would read it from."""
    tiers = {tier_of(m) for m in media}
    return DEVICE if DEVICE in tiers else HOST if HOST in tiers else STORAGE
