"""One `serve` process for the API tests: a tiny random Llama with the default model's real
tokenizer and chat template (tests/tiny_models.py), dense float32 weights, an API key; and the
same checkpoint loaded in-process as the reference engine."""

from __future__ import annotations

import pytest

from tests.api.helpers import API_KEY, MODEL, ServeProc

NUM_BLOCKS = 256


@pytest.fixture(scope="session")
def tiny_dir():
    from tests.tiny_models import tiny_model_dir

    return tiny_model_dir("llama", num_layers=2, max_position_embeddings=512)


@pytest.fixture(scope="session")
def server(tiny_dir):
    proc = ServeProc(
        [
            "--port", "0", "--model", str(tiny_dir), "--dtype", "float32",
            "--decode-weights", "dense", "--api-key", API_KEY, "--served-model-name", MODEL,
            "--engine-args", f"--num-threads 1 --num-kv-blocks {NUM_BLOCKS} --telemetry-hz 50",
        ]
    )  # fmt: skip
    try:
        yield proc.wait_healthy()
    finally:
        proc.stop()


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


@pytest.fixture()
def sdk(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture()
def async_sdk(server):
    import openai

    return openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120
    )
