"""The state LLMEngine (engine_proc/engine/llm_engine.py) builds in its constructor, declared once
for the mixins it is made of (engine_tokens, engine_outputs, engine_control): each reads these
attributes from the engine that inherits it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from engine_proc.attention.base import AttentionBackend
    from engine_proc.config import EngineConfig
    from engine_proc.core.kv_cache_manager import KVCacheManager
    from engine_proc.core.request import Sequence
    from engine_proc.core.scheduler import Scheduler
    from engine_proc.engine.metrics import RequestHistograms
    from engine_proc.engine.telemetry import EngineStats
    from engine_proc.executor.model_runner import ModelRunner
    from engine_proc.kv_transfer.transfer import KVTransfer
    from engine_proc.models.config import ModelConfig
    from engine_proc.models.llama import LlamaModel


class EngineParts:
    config: EngineConfig
    clock: Callable[[], float]
    checkpoint_name: str
    model_config: ModelConfig
    model_id: str
    tokenizer: Any
    device: torch.device
    backend: AttentionBackend
    decode_weights: str
    kv_cache_dtype: str
    cache_identity: str
    block_size: int
    block_bytes: int
    num_blocks: int
    kv_bytes_per_token: int
    max_model_len: int
    model: LlamaModel
    runner: ModelRunner
    kv: KVCacheManager
    scheduler: Scheduler
    transfer: KVTransfer
    requests: dict[str, list[Sequence]]
    stats: EngineStats
    histograms: RequestHistograms
    # engine/speculation.py: a finished sequence's draft-model grammar state is dropped
    _forget_drafts: Callable[[Sequence], None]
