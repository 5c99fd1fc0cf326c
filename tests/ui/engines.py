"""Engine factory for the GUI tests:
`python -m engine_proc serve --engine-factory tests.ui.engines:tiny_chat`.

A tiny random Llama (tests/tiny_models/) with the real SmolLM2 tokenizer and chat template, so
the chat panel's messages go through the ordinary path, while loading takes seconds and decoding
is fast. Random weights rarely emit EOS: replies run to max_tokens, which keeps tests predictable.
Runs inside the engine process only (the GUI test process never imports torch).
"""

from __future__ import annotations

import argparse

from engine_proc import EngineConfig, LLMEngine
from engine_proc.config import kv_tier_options


def tiny_chat(args: argparse.Namespace) -> LLMEngine:
    from tests.tiny_models import tiny_model_dir

    config: dict[str, object] = dict(
        model=str(tiny_model_dir("llama")),
        dtype=args.dtype,
        device="cpu",
        block_size=args.block_size,
        num_kv_blocks=args.num_blocks or 128,
        max_model_len=args.max_model_len or 512,
        enable_prefix_caching=not args.no_prefix_caching,
        attention_backend="torch",
        num_threads=args.num_threads or 1,
        decode_weights=args.decode_weights,
    )
    for name in ("max_num_seqs", "max_num_batched_tokens", "long_prefill_chunk"):
        if getattr(args, name) is not None:
            config[name] = getattr(args, name)
    config.update(kv_tier_options(args))  # the KV element type and lower tiers (Engine menu)
    config["speculative_config"] = getattr(args, "speculative_config", None)  # (Engine menu)
    return LLMEngine(EngineConfig(**config))
