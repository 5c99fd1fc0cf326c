"""The speculative-decoding benchmarks' prompts (issue 35), as chat messages and as token ids.

Prompt lookup (n-gram speculation) only has drafts to offer where the answer repeats the input:
`quote` (repeat a document, then summarise it) and `edit-code` (rewrite code, keeping most of it)
are such prompts; `free` (a short story) is the control where it has few. Real text, not random
token ids: the repetition is the point. Shared by `python -m engine_proc.bench.spec_ngram` and the
main benchmark's spec-ngram / spec-draft workloads, whose driver (app.bench) gets the token ids
from the `ceilings` worker (`chat_prompt_ids`), so every system serves the very same ids.
"""

from __future__ import annotations

from typing import Any

DOCUMENT = (
    "The paged KV cache stores the keys and values of every token in fixed-size blocks. A block "
    "table maps each request's logical blocks to physical ones, so memory is allocated as a "
    "reply grows instead of being reserved for the longest possible reply. Blocks whose tokens "
    "form a common prefix are shared between requests through a hash of their contents, which "
    "is what prefix caching means: the system prompt is computed once and reused.")
CODE = '''def mean(values):
    total = 0
    for v in values:
        total = total + v
    return total / len(values)


def variance(values):
    m = mean(values)
    total = 0
    for v in values:
        total = total + (v - m) * (v - m)
    return total / len(values)
'''
PROMPTS = {
    "quote": "Repeat the following text exactly, then say in one sentence what it is about.\n\n"
             + DOCUMENT,
    "edit-code": "Rewrite this Python code with type hints, keeping everything else the same.\n\n"
                 + CODE,
    "free": "Write a short story about a cat who learns to play the piano.",
}


def chat_prompt_ids(tokenizer: Any) -> dict[str, list[int]]:
    """Each prompt as one user turn under the model's chat template (as LLMEngine.tokenize_chat
    renders it), or as plain text with BOS for a model without one."""
    from engine_proc.engine.chat_render import ChatPrompt, render

    out = {}
    for kind, text in PROMPTS.items():
        if getattr(tokenizer, "chat_template", None):
            rendered = render(tokenizer, ChatPrompt([{"role": "user", "content": text}]), True)
            out[kind] = list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
        else:
            out[kind] = list(tokenizer(text)["input_ids"])
    return out
