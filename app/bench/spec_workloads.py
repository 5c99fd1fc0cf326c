"""The speculative-decoding workloads of the benchmark (issue 35): spec-ngram-N and spec-draft-N.

N concurrent greedy streams of real chat prompts whose answers repeat the input (quote a
document, edit code: engine_proc/bench/spec_prompts.py), at most `spec_new` tokens each. Unlike
every other workload they stop at the model's end of turn (`ignore_eos` false), as a chat does:
past it the model writes unrelated free text (a new conversation), which would dilute what
these workloads measure, speculation on an answer that repeats its prompt.
The token ids come from the `ceilings` worker (the model's own tokenizer and chat template), so
every system serves the very same ids; each request carries its prompt `kind`.

- N = 1: one request of each kind, one after the other (each starts when the previous has
  finished), so every request decodes alone.
- N > 1: N requests at once, kinds taken in turn.

Systems: kvscope (no speculation), kvscope-spec (the workload's `meta.speculative_config`:
n-gram prompt lookup for spec-ngram, the `--draft-model` for spec-draft), llamacpp (plain) and,
for spec-ngram, llamacpp-lookup (llama-cpp-python's LlamaPromptLookupDecoding, one sequence at a
time; n/a at N > 1). Like every workload module, a pure function of its inputs that imports
nothing from the app.
"""

from __future__ import annotations

from typing import Any

SPEC_LEVELS = (1, 16)
SPEC_FAMILIES = ("spec-ngram", "spec-draft")
SPEC_WORKLOADS = tuple(f"{f}-{n}" for f in SPEC_FAMILIES for n in SPEC_LEVELS)
# The prompt kinds each family serves: prompt lookup only helps where the answer repeats the
# input; a draft model is not limited to that, so spec-draft adds the free-text control.
SPEC_KINDS = {"spec-ngram": ("quote", "edit-code"), "spec-draft": ("quote", "edit-code", "free")}
# kvscope-spec on spec-ngram (engine_proc/config.py SpeculativeConfig; disable_by_batch_size is
# left at the engine's default, which turns drafts off in a wide batch by itself).
NGRAM_CONFIG = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4,
                "prompt_lookup_min": 2}
DRAFT_TOKENS = 4  # num_speculative_tokens of spec-draft (vLLM's shape: {"model", ...})
# llamacpp-lookup's LlamaPromptLookupDecoding(max_ngram_size, num_pred_tokens): n-grams of at
# most 4 tokens as NGRAM_CONFIG's, and 4 drafts, its better count: it drafts a fixed number
# (kvscope's draft length adapts, up to 8). Measured 2026-12-07, 2 Zen 4 cores, `--workloads
# spec-ngram-1 --repeats 3 --threads 2`: 123 tok/s with 4, 93.7 with 8.
LOOKUP_OPTIONS = {"max_ngram_size": 4, "num_pred_tokens": 4}
SPEC_WORKLOAD_SYSTEMS = {
    **{f"spec-ngram-{n}": ("kvscope", "kvscope-spec", "llamacpp", "llamacpp-lookup")
       for n in SPEC_LEVELS},
    **{f"spec-draft-{n}": ("kvscope", "kvscope-spec", "llamacpp") for n in SPEC_LEVELS},
}
# Why a system has no number: shown in the table instead of a ratio.
NO_DRAFT_PEER = ("n/a: llama-cpp-python speculates with a draft model only through a "
                 "LlamaDraftModel subclass in Python, not a GGUF draft model")
NO_BATCHED_LOOKUP = ("n/a: llama-cpp-python's prompt lookup runs in the high-level Llama, one "
                     "sequence at a time (its batched C API has no speculation)")
NEEDS_DRAFT = "spec-draft needs --draft-model PATH (the draft model of speculative_config)"
# kvscope's engine settings: what the app runs on a CPU by default, as in the streams workloads
# (4-bit weights, the fused step, 8-bit activations on AVX2: `auto`).
SPEC_ENGINE = {"decode_weights": "auto", "decode_step": "fused", "decode_activations": "auto"}


def spec_level(name: str) -> tuple[str, int] | None:
    """(family, N) of a spec-ngram-N / spec-draft-N workload name, else None."""
    family, _, n = name.rpartition("-")
    return (family, int(n)) if family in SPEC_FAMILIES and n.isdigit() else None


def spec_group(name: str, levels: tuple[int, ...]) -> list[str] | None:
    """`spec-ngram` / `spec-draft` -> their N workloads at `levels`, else None."""
    return [f"{name}-{n}" for n in levels] if name in SPEC_FAMILIES else None


def build_spec(name: str, prompts: dict[str, list[int]], new_tokens: int,
               draft_model: str | None = None) -> tuple[list[dict], dict, dict]:
    """The requests, engine overrides and meta of a spec workload. `prompts`: token ids of
    each prompt kind (the ceilings worker's `chat_prompts`)."""
    level = spec_level(name)
    if level is None:
        raise ValueError(f"not a spec workload: {name!r}")
    family, n = level
    kinds = SPEC_KINDS[family]
    missing = [k for k in kinds if not prompts.get(k)]
    if missing:
        raise ValueError(f"{name} needs the token ids of the prompts {missing} (the ceilings "
                         "worker's model.chat_prompts)")
    reqs: list[dict[str, Any]] = []
    if n == 1:
        for i, kind in enumerate(kinds):
            when: dict[str, Any] = ({"arrival_s": 0.0} if i == 0 else
                                    {"after": {"request": reqs[-1]["id"], "tokens": -1}})
            reqs.append({"id": f"{kind}-0", "kind": kind, "prompt": list(prompts[kind]),
                         "max_tokens": new_tokens, "ignore_eos": False, **when})
    else:
        for i in range(n):
            kind = kinds[i % len(kinds)]
            reqs.append({"id": f"{kind}-{i}", "kind": kind, "prompt": list(prompts[kind]),
                         "max_tokens": new_tokens, "ignore_eos": False, "arrival_s": 0.0})
    if family == "spec-ngram":
        spec: dict[str, Any] = dict(NGRAM_CONFIG)
    else:  # the path is filled in by the driver; without one the workload is skipped
        spec = {"model": draft_model, "num_speculative_tokens": DRAFT_TOKENS}
    meta = {"streams": n, "kinds": list(kinds), "speculative_config": spec,
            "lookup": dict(LOOKUP_OPTIONS)}
    return reqs, dict(SPEC_ENGINE), meta
