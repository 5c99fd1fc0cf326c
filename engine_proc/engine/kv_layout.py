"""Which KV layout the engine runs (engine_proc/core/kv_groups.py): blocks released as they leave
a sliding window where the model has sliding layers and nothing configured needs every block.

`hybrid_kv` None (the default) releases them unless KV tiers are on (they hold whole prefixes)
or, for a model with full and sliding layers, fp8 KV is (its per-layer scales do not follow a
layer's slot in a shared page); then every block is kept, which the log says. True insists and
refuses those combinations by name; False always keeps every block. A window that covers the
whole context releases nothing, so such a model keeps one full group."""

from __future__ import annotations

import logging

from engine_proc.config import EngineConfig
from engine_proc.core.kv_groups import KVLayout
from engine_proc.core.kv_sizing import engine_layout
from engine_proc.models.config import ModelConfig

logger = logging.getLogger("engine_proc.engine.llm_engine")  # the engine's log, as before


def choose_kv_layout(mc: ModelConfig, config: EngineConfig, kv_dtype: str,
                     max_model_len: int) -> KVLayout:  # fmt: skip
    window = mc.sliding_window
    layout = engine_layout(mc.layer_types, mc.num_layers, window, config.hybrid_kv is not False,
                           max_model_len)  # fmt: skip
    if not layout.has_sliding_groups:
        return layout
    tiers = bool(config.kv_host_memory) or config.kv_disk_dir is not None
    fp8 = kv_dtype == "fp8" and layout.is_hybrid
    if config.hybrid_kv is None and (tiers or fp8):
        logger.info("%s keeps every block of its sliding-window layers: %s need them "
                    "(hybrid_kv=True refuses the combination instead)", mc.architecture,
                    "KV tiers" if tiers else "fp8 KV scales")  # fmt: skip
        return engine_layout(mc.layer_types, mc.num_layers, window, False, max_model_len)
    if fp8:
        raise ValueError("kv_cache_dtype='fp8' (per-layer scales) with a hybrid KV cache "
                         f"({mc.architecture}) is not supported; leave hybrid_kv unset or False "
                         "(--hybrid-kv auto / off), or use another kv_cache_dtype")  # fmt: skip
    if layout.is_hybrid:
        logger.info("hybrid KV cache: %d groups of %d layers (full: layers %s; window %d)",
                    layout.num_groups, layout.group_size, layout.layers_of(0),
                    window)  # fmt: skip
    else:
        logger.info("sliding-window KV cache: every layer's window is %d tokens; blocks that "
                    "leave it are released", window)  # fmt: skip
    return layout
