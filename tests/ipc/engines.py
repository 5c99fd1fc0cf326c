"""Engine factories for `python -m engine_proc.server --engine-factory tests.ipc.engines:tiny`.

The tiny random Llama (tests/engine_fixtures.py) loads in a second and decodes fast, so the heavy
IPC tests (64 clients, fuzzing, telemetry rates) stay quick on a busy 2-core machine.
"""

from __future__ import annotations

import argparse

from engine_proc import LLMEngine


def tiny(args: argparse.Namespace) -> LLMEngine:
    from tests.engine_fixtures import tiny_engine

    config: dict[str, object] = dict(
        dtype=args.dtype,
        device="cpu",
        block_size=args.block_size,
        num_kv_blocks=args.num_blocks or 256,
        enable_prefix_caching=not args.no_prefix_caching,
        attention_backend="torch",
        num_threads=args.num_threads,
    )
    for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "long_prefill_chunk"):
        if getattr(args, name) is not None:
            config[name] = getattr(args, name)
    return tiny_engine(**config)


def paced_tiny(args: argparse.Namespace) -> LLMEngine:
    """The tiny engine with every step padded to at least 20 ms, so that a test can act while a
    request is still running (the tiny model alone runs 400 tokens in a fraction of a second)."""
    import time

    engine = tiny(args)
    step = engine.step

    def paced_step():  # type: ignore[no-untyped-def]
        start = time.monotonic()
        outputs = step()
        time.sleep(max(0.0, 0.02 - (time.monotonic() - start)))
        return outputs

    engine.step = paced_step  # type: ignore[method-assign]
    return engine


def fake(args: argparse.Namespace) -> object:
    """tests/ipc/fake_engine.py's torch-free engine (one "x" per request per step, each step at
    least 5 ms): an engine process that starts in a fraction of a second."""
    from tests.ipc.fake_engine import FakeEngine

    return FakeEngine(num_blocks=args.num_blocks or 64, step_sleep=0.005)
