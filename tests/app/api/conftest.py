"""The API tests share the session's `serve` process (tests/conftest.py: `server`); here the same
checkpoint loaded in-process as the reference engine, and the official SDK clients."""

from __future__ import annotations

import pytest

from tests.app.api.helpers import NUM_BLOCKS


@pytest.fixture(scope="session")
def reference(tiny_dir):
    """The in-process engine on the same checkpoint (the tokens the API must return)."""
    import torch

    from engine_proc import EngineConfig, LLMEngine

    threads = torch.get_num_threads()
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_dir), dtype="float32", decode_weights="dense",
            num_kv_blocks=NUM_BLOCKS, attention_backend="torch", device="cpu",
        )
    )  # fmt: skip
    torch.set_num_threads(threads)
    return engine
