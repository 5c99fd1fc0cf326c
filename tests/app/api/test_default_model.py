"""Once with the default model (SmolLM2-135M GGUF): the SDK's greedy chat through `serve` equals
the in-process engine token for token."""

from __future__ import annotations

import pytest

from engine_proc import SamplingParams
from tests.app.api.helpers import ServeProc

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def test_default_model_chat_through_the_sdk_equals_the_in_process_engine(
    default_engine_factory,
) -> None:
    import openai
    import torch

    serve = ServeProc(
        ["--port", "0", "--dtype", "float32", "--decode-weights", "dense",
         "--engine-args", "--num-threads 1 --num-kv-blocks 128"]
    )  # fmt: skip
    threads = torch.get_num_threads()
    try:
        reference = default_engine_factory(num_kv_blocks=128, device="cpu", num_threads=1)
        [want] = reference.generate([MESSAGES], SamplingParams(max_tokens=12, temperature=0))
        serve.wait_healthy(600)
        client = openai.OpenAI(base_url=serve.url + "/v1", api_key="unused", max_retries=0)
        [model] = client.models.list().data
        got = client.chat.completions.create(
            model=model.id, messages=MESSAGES, max_tokens=12, temperature=0,
            logprobs=True,
        )  # fmt: skip
    finally:
        serve.stop()
        torch.set_num_threads(threads)
    assert model.id == "SmolLM2-135M-Instruct"
    assert got.choices[0].message.content == want.text
    assert len(got.choices[0].logprobs.content) == len(want.token_ids)
    assert got.usage.completion_tokens == len(want.token_ids)
    assert got.usage.prompt_tokens == want.num_prompt_tokens
