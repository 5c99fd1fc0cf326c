"""Greedy completions of the default model equal transformers' generate() on the same GGUF."""

import pytest

from engine_proc import SamplingParams

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


PARITY_TOKENS = 48


@pytest.mark.slow
def test_greedy_completions_equal_transformers_generate(default_engine_factory, parity_references):
    engine = default_engine_factory(dtype="float32")
    prompt_ids, refs = parity_references  # transformers' generate() on each prompt
    lengths = [len(p) for p in prompt_ids]
    assert min(lengths) <= 20 and 300 <= max(lengths) <= 400, lengths
    params = SamplingParams(max_tokens=PARITY_TOKENS, temperature=0)
    outputs = engine.generate(PROMPTS, params)  # all in one call: batched forward passes

    for ids, out, ref in zip(prompt_ids, outputs, refs, strict=True):
        assert out.token_ids == ref, engine.tokenizer.decode(ids)
        assert out.finish_reason == ("stop" if ref[-1] == 2 else "length")
    assert engine.kv.pool.num_free == engine.num_blocks
