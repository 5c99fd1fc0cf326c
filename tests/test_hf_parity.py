"""Greedy completions of the default model equal transformers' generate() on the same GGUF."""

import pytest
import torch

from engine_proc import SamplingParams
from engine_proc.model_loader import default_model_path

LONG_TEXT = (
    "The history of paged memory begins with virtual memory systems in the 1960s, where the "
    "operating system split a program's address space into fixed-size pages and kept a page "
    "table mapping each virtual page to a physical frame. "
) * 6

PROMPTS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "List three prime numbers and explain why they are prime."}],
    [
        {"role": "system", "content": "You are a pirate. Answer like one."},
        {"role": "user", "content": "How do I make a cup of tea?"},
    ],
    [
        {"role": "user", "content": "What is 12 times 7?"},
        {"role": "assistant", "content": "12 times 7 is 84."},
        {"role": "user", "content": "And divided by 4?"},
    ],
    [{"role": "user", "content": "Summarize this text in one sentence:\n" + LONG_TEXT}],
    [{"role": "user", "content": "Translate to French: The cat sleeps on the warm window sill."}],
]


@pytest.mark.slow
def test_greedy_completions_equal_transformers_generate(default_engine_factory):
    from transformers import AutoModelForCausalLM

    engine = default_engine_factory(dtype="float32")
    prompt_ids = [engine.tokenize(p) for p in PROMPTS]
    lengths = [len(p) for p in prompt_ids]
    assert min(lengths) <= 20 and 300 <= max(lengths) <= 400, lengths
    params = SamplingParams(max_tokens=48, temperature=0)
    outputs = engine.generate(PROMPTS, params)  # all in one call: batched forward passes

    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    for ids, out in zip(prompt_ids, outputs, strict=True):
        ref = hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=48,
            do_sample=False,
            eos_token_id=2,
            pad_token_id=2,
        )[0, len(ids) :].tolist()
        assert out.token_ids == ref, engine.tokenizer.decode(ids)
        assert out.finish_reason == ("stop" if ref[-1] == 2 else "length")
    assert engine.kv.pool.num_free == engine.num_blocks
