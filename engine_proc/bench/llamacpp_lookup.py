"""The benchmark's llamacpp-lookup system: llama.cpp with its own prompt-lookup decoding, the
peer of kvscope-spec on the spec-ngram workloads. Run through `python -m engine_proc.bench.worker
--system llamacpp-lookup`.

llama-cpp-python speculates only in its high-level `Llama.generate`, with a `draft_model`
(`llama_cpp.llama_speculative.LlamaPromptLookupDecoding(max_ngram_size, num_pred_tokens)`, the
workload's `meta.lookup`): one sequence at a time. So this system serves workloads whose requests
run one after another (spec-ngram-1) and is skipped, with the reason, where they run at once:
the batched C API that the llamacpp system drives (engine_proc/bench/llamacpp.py) has no
speculation. Greedy (temp 0, no repeat penalty); a request ends at max_tokens or, when its
`ignore_eos` is false (the spec workloads), at an end-of-generation token (generate() itself
never stops). Token times are stamped as generate() yields them (accepted drafts come out
together). The same GGUF as every other system, and the same flash attention as the llamacpp
system (--llamacpp-flash-attn): the high-level API has only on or off, and llama.cpp's "auto"
turns it on on a CPU (with it, the two give the same greedy tokens on the tiny test model; with
the high-level default, off, a near-tie fell the other way).
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from typing import Any

from engine_proc.bench.common import (
    WARMUP_PROMPT,
    WARMUP_TOKENS,
    Req,
    model_path,
    parse_workload,
    request_results,
    summarize,
)
from engine_proc.bench.llamacpp import CTX_PAD, N_BATCH, skip_reason

DEFAULT_LOOKUP = {"max_ngram_size": 4, "num_pred_tokens": 4}
ONE_AT_A_TIME = ("llama-cpp-python's prompt lookup runs in the high-level Llama, one sequence at "
                 "a time (its batched C API has no speculation)")


def concurrent(reqs: list[Req]) -> bool:
    """Whether any two requests may run at once: more than one timed arrival, or an event
    request that does not wait for an earlier one to finish."""
    timed = [r for r in reqs if r.arrival_s is not None]
    return len(timed) > 1 or any(r.after is not None and r.after["tokens"] >= 0 for r in reqs)


def generate(llm: Any, r: Req, clock: Any = time.monotonic) -> None:
    """One request through Llama.generate, greedy, up to max_tokens tokens."""
    import llama_cpp

    r.issued = clock()
    r.token_ids = []
    for token in llm.generate(r.prompt, temp=0.0, repeat_penalty=1.0, reset=True):
        r.token_times.append(clock())
        r.token_ids.append(int(token))
        r.num_out += 1
        if r.num_out >= r.max_tokens or (
                not r.ignore_eos and llama_cpp.llama_vocab_is_eog(llm._model.vocab, token)):
            break
    r.finished = True


def run_llamacpp_lookup(workload: dict, args: argparse.Namespace) -> dict:
    why = skip_reason(args.model)
    if why:
        return {"skipped": why}
    reqs = parse_workload(workload)
    if concurrent(reqs):
        return {"skipped": f"n/a: {ONE_AT_A_TIME}"}
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    lookup = dict(workload.get("meta", {}).get("lookup") or DEFAULT_LOOKUP)
    threads = args.threads or os.cpu_count() or 1
    flash_attn = getattr(args, "llamacpp_flash_attn", "auto") != "off"
    # One sequence: the longest request plus a round of drafts past its end.
    longest = max(len(r.prompt) + r.max_tokens for r in reqs) + lookup["num_pred_tokens"] + 1
    n_ctx = -(-longest // CTX_PAD) * CTX_PAD
    t_load = time.monotonic()
    llm = Llama(model_path=str(model_path(args.model)), n_ctx=n_ctx, n_batch=min(N_BATCH, n_ctx),
                n_threads=threads, n_threads_batch=threads, verbose=False, flash_attn=flash_attn,
                draft_model=LlamaPromptLookupDecoding(**lookup))
    try:
        load_s = time.monotonic() - t_load
        generate(llm, Req("warmup", WARMUP_PROMPT, WARMUP_TOKENS, 0.0, None))
        t0 = time.monotonic()
        for r in reqs:  # in order: each waits for the one before it (concurrent() said so)
            generate(llm, r)
    finally:
        llm.close()
    result = summarize(reqs, t0)
    result.update({"load_s": load_s, "prefix_hit_rate": None,
                   "llamacpp": {"api": "llama_cpp.Llama.generate + LlamaPromptLookupDecoding",
                                "lookup": lookup, "n_ctx": n_ctx, "n_threads": threads,
                                "flash_attn": flash_attn,
                                "version": _version()},
                   "requests": request_results(reqs, t0)})
    return result


def _version() -> str | None:
    import llama_cpp

    return getattr(llama_cpp, "__version__", None)
