"""Engine factory for the KV cache menu's window test: tests/ui/engines.py's tiny chat model with
the KV element type and lower-tier flags applied (`--kv-cache-dtype`, `--kv-host-memory`,
`--kv-disk-dir`, `--kv-disk-bytes`), so the window's choices reach a real engine. Runs inside the
engine process only."""

from __future__ import annotations

import argparse

from engine_proc import EngineConfig, LLMEngine
from engine_proc.config import kv_tier_options


def tiny_chat_kv(args: argparse.Namespace) -> LLMEngine:
    from tests.tiny_models import tiny_model_dir

    return LLMEngine(EngineConfig(
        model=str(tiny_model_dir("llama")),
        dtype=args.dtype,
        device="cpu",
        block_size=args.block_size,
        num_kv_blocks=args.num_blocks or 128,
        max_model_len=args.max_model_len or 512,
        attention_backend="torch",
        num_threads=args.num_threads or 1,
        **kv_tier_options(args),  # type: ignore[arg-type]
    ))
