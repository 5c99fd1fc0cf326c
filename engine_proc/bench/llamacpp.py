"""The benchmark's llama.cpp system: llama-cpp-python's low-level C API, driven the way llama.cpp's
own `batched` / `batched-bench` examples and its server drive it, so that concurrent requests
share every llama_decode call (the high-level `Llama` class serves one sequence at a time).
Run through `python -m engine_proc.bench.worker --system llamacpp`.

- One llama_context for the run: n_seq_max = the workload's concurrency (its request count, at
  most MAX_SEQS, kvscope's default max_num_seqs), a KV cache that holds every concurrent request
  at full length, n_threads = n_threads_batch = --threads.
- Every loop: requests that have arrived (Issuer, as for the other systems) take the lowest free
  sequence id; prompts waiting for prefill are fed in one llama_decode call (several prompts per
  call, up to N_BATCH tokens, a longer prompt in chunks), the last prompt token of each asking
  for logits; then every running sequence feeds its last token in ONE llama_decode call (one
  token per sequence). Each sampled token is stamped when its call has returned and the token is
  picked: greedy (argmax of llama_get_logits_ith) unless the request asks for a temperature. EOS
  is ignored, as for every system here: each request produces exactly max_tokens tokens (except a
  request with `ignore_eos` false, which ends at an end-of-generation token, as in a chat).
- A finished sequence's KV is dropped (llama_memory_seq_rm) and its id goes back to the pool.
- KV layout, `kv`: "split" (default; llama.cpp's own for n_seq_max > 1, `llama-server -np N`
  without `-kvu`): one KV stream of n_ctx / n_seq_max cells per sequence, attention reads only its
  own. llama.cpp then splits a batch into micro-batches of consecutive sequence ids, so batches
  are sent in ascending id order and ids are reused lowest first. "unified" (`-kvu`): one buffer
  for all sequences, masked attention over every used cell.
- Flash attention: llama.cpp's own default ("auto") unless `flash_attn` says otherwise.

Both defaults are llama.cpp's best here: 64 streams x 128 tokens of the default model on the
2-core development machine decode at 197 tok/s split, 57 unified (every stream's attention reads
all 64 streams' cells), and 166 with flash attention off.

With one request this is exactly the high-level API's greedy loop: the prompt in one call, then
one token per call (tests/engine_proc/bench/test_llamacpp.py compares the two token for token).
"""

from __future__ import annotations

import argparse
import heapq
import importlib.util
import logging
import os
import time
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine_proc.bench.common import (
    WARMUP_PROMPT,
    WARMUP_TOKENS,
    Issuer,
    Req,
    model_path,
    parse_workload,
    request_results,
    summarize,
)

INSTALL_HINT = "pip install llama-cpp-python"
KV_LAYOUTS = ("split", "unified")
FLASH_ATTN = ("auto", "on", "off")
MAX_SEQS = 64  # kvscope's default max_num_seqs: the most sequences either system runs at once
N_BATCH = 2048  # tokens per llama_decode call (kvscope's default max_num_batched_tokens)
N_UBATCH = 512  # llama.cpp's default micro-batch
CTX_PAD = 256  # llama.cpp rounds context sizes to this


def skip_reason(model: str | None) -> str | None:
    """Why this system cannot run here (llama-cpp-python missing, not a GGUF), else None."""
    if importlib.util.find_spec("llama_cpp") is None:
        return f"llama-cpp-python is not installed ({INSTALL_HINT})"
    path = model_path(model)
    if not path.is_file():
        return f"llama.cpp needs a .gguf file, got directory {path}"
    return None


def _pad(n: int) -> int:
    return -(-n // CTX_PAD) * CTX_PAD


@dataclass(slots=True)
class Plan:
    """The context a workload needs."""

    n_seq: int
    n_ctx: int
    seq_len: int  # the longest request: prompt + max_tokens

    @classmethod
    def for_requests(cls, reqs: list[Req], kv: str) -> Plan:
        if kv not in KV_LAYOUTS:
            raise ValueError(f"kv must be one of {KV_LAYOUTS}, got {kv!r}")
        lengths = sorted((len(r.prompt) + r.max_tokens for r in reqs), reverse=True)
        n_seq = min(len(reqs), MAX_SEQS)
        if kv == "split":  # every stream holds the longest request
            n_ctx = n_seq * _pad(lengths[0])
        else:  # the n_seq longest requests at once
            n_ctx = _pad(sum(lengths[:n_seq]))
        return cls(n_seq, n_ctx, lengths[0])


class BatchedLlama:
    """One llama.cpp model + context + token batch, through llama_cpp's C bindings."""

    def __init__(self, path: Path, plan: Plan, threads: int, kv: str = "split",
                 flash_attn: str = "auto") -> None:
        if flash_attn not in FLASH_ATTN:
            raise ValueError(f"flash_attn must be one of {FLASH_ATTN}, got {flash_attn!r}")
        import llama_cpp as lib

        # llama-cpp-python routes llama.cpp's log through this logger; INFO prints every tensor.
        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
        self.lib = lib
        lib.llama_backend_init()
        mparams = lib.llama_model_default_params()
        self.model = lib.llama_model_load_from_file(str(path).encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = plan.n_ctx
        cparams.n_batch = max(N_BATCH, plan.n_seq)
        cparams.n_ubatch = N_UBATCH
        cparams.n_seq_max = plan.n_seq
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.kv_unified = kv == "unified"
        cparams.flash_attn_type = {"auto": lib.LLAMA_FLASH_ATTN_TYPE_AUTO,
                                   "on": lib.LLAMA_FLASH_ATTN_TYPE_ENABLED,
                                   "off": lib.LLAMA_FLASH_ATTN_TYPE_DISABLED}[flash_attn]
        self.ctx = lib.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            lib.llama_model_free(self.model)
            raise RuntimeError(f"llama.cpp could not create a context of {plan.n_ctx} tokens, "
                               f"{plan.n_seq} sequences")
        self.n_batch = lib.llama_n_batch(self.ctx)  # llama.cpp caps it at n_ctx
        self.n_ctx_seq = lib.llama_n_ctx_seq(self.ctx)
        if self.n_ctx_seq < plan.seq_len:
            self.close()
            raise RuntimeError(f"llama.cpp gave each sequence {self.n_ctx_seq} cells, the "
                               f"longest request needs {plan.seq_len}")
        self.mem = lib.llama_get_memory(self.ctx)
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.n_vocab = lib.llama_vocab_n_tokens(self.vocab)
        self.batch = lib.llama_batch_init(self.n_batch, 0, 1)
        self.info = {"n_ctx": lib.llama_n_ctx(self.ctx), "n_ctx_seq": self.n_ctx_seq,
                     "n_seq_max": plan.n_seq, "n_batch": self.n_batch, "n_ubatch": N_UBATCH,
                     "n_threads": threads, "kv": kv, "flash_attn": flash_attn}

    def decode(self, entries: list[tuple[int, int, list[int], bool]]) -> list[int]:
        """One llama_decode call. entries: (sequence id, position of the first token, tokens,
        whether the last token's logits are wanted). Returns each entry's last batch index."""
        b = self.batch
        n = 0
        last = []
        for seq, pos, tokens, want in entries:
            for j, t in enumerate(tokens):
                b.token[n] = t
                b.pos[n] = pos + j
                b.n_seq_id[n] = 1
                b.seq_id[n][0] = seq
                b.logits[n] = 0
                n += 1
            b.logits[n - 1] = 1 if want else 0
            last.append(n - 1)
        assert 0 < n <= self.n_batch, n
        b.n_tokens = n
        rc = self.lib.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} for {n} tokens of {len(entries)} "
                               "sequences")
        return last

    def logits(self, i: int) -> np.ndarray:
        ptr = self.lib.llama_get_logits_ith(self.ctx, i)
        if not ptr:
            raise RuntimeError(f"llama.cpp has no logits for batch index {i}")
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def is_eog(self, token: int) -> bool:
        """Whether `token` ends generation (EOS, end of turn) for this model."""
        return bool(self.lib.llama_vocab_is_eog(self.vocab, token))

    def drop(self, seq: int) -> None:
        self.lib.llama_memory_seq_rm(self.mem, seq, -1, -1)

    def clear(self) -> None:
        self.lib.llama_memory_clear(self.mem, True)

    def close(self) -> None:
        lib = self.lib
        if getattr(self, "batch", None) is not None:
            lib.llama_batch_free(self.batch)
            self.batch = None
        if self.ctx:
            lib.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            lib.llama_model_free(self.model)
            self.model = None


@dataclass(slots=True, eq=False)  # compared by identity
class Slot:
    """A request holding a sequence id."""

    req: Req
    seq: int
    n_past: int = 0  # tokens in its KV
    last: int = -1  # the sampled token not yet fed
    rng: Any = None  # a sampled request's random stream


def pick(logits: np.ndarray, slot: Slot) -> int:
    r = slot.req
    if r.temperature <= 0:
        return int(np.argmax(logits))
    if slot.rng is None:
        seed = r.seed if r.seed is not None else zlib.crc32(r.id.encode())
        slot.rng = np.random.default_rng(seed)
    x = logits.astype(np.float64) / r.temperature
    p = np.exp(x - x.max())
    return int(slot.rng.choice(len(p), p=p / p.sum()))


def serve(llm: BatchedLlama, reqs: list[Req], clock: Callable[[], float], t0: float,
          n_seq: int) -> dict[str, int]:
    """Serve `reqs`, arriving relative to `t0`, to the end (their token_times, token_ids,
    num_out, finished); returns call counts."""
    issuer = Issuer(reqs, t0)
    free = list(range(n_seq))  # a heap: lowest id first keeps the running ids consecutive
    waiting: deque[Req] = deque()  # arrived, no sequence id yet
    prefilling: list[Slot] = []  # in arrival order
    running: dict[int, Slot] = {}  # seq -> slot with a token to feed
    stats = {"prefill_calls": 0, "decode_calls": 0, "max_running": 0}

    def emit(slot: Slot, token: int, now: float) -> None:
        r = slot.req
        r.token_times.append(now)
        r.token_ids.append(token)
        r.num_out += 1
        if r.num_out >= r.max_tokens or (not r.ignore_eos and llm.is_eog(token)):
            r.finished = True
            running.pop(slot.seq, None)
            llm.drop(slot.seq)
            heapq.heappush(free, slot.seq)
        else:
            slot.last = token
            running[slot.seq] = slot

    while issuer.pending or waiting or prefilling or running:
        waiting.extend(issuer.due(clock()))
        while waiting and free:
            r = waiting.popleft()
            r.token_ids = []
            prefilling.append(Slot(r, heapq.heappop(free)))
        if not prefilling and not running:
            issuer.wait_for_next(clock)
            continue
        if prefilling:
            budget = llm.n_batch
            entries: list[tuple[Slot, int, bool]] = []  # slot, tokens, completes its prompt
            for slot in prefilling:
                take = min(budget, len(slot.req.prompt) - slot.n_past)
                if take <= 0:
                    break
                entries.append((slot, take, slot.n_past + take == len(slot.req.prompt)))
                budget -= take
            entries.sort(key=lambda e: e[0].seq)
            last = llm.decode([(s.seq, s.n_past, s.req.prompt[s.n_past:s.n_past + k], done)
                               for s, k, done in entries])
            stats["prefill_calls"] += 1
            tokens = [pick(llm.logits(i), s) for (s, _, done), i in zip(entries, last,
                                                                         strict=True) if done]
            now = clock()
            finished = [s for s, _, done in entries if done]
            for (s, k, _) in entries:
                s.n_past += k
            prefilling = [s for s in prefilling if s not in finished]
            for s, token in zip(finished, tokens, strict=True):
                emit(s, token, now)
        if running:
            active = sorted(running.values(), key=lambda s: s.seq)
            stats["max_running"] = max(stats["max_running"], len(active))
            last = llm.decode([(s.seq, s.n_past, [s.last], True) for s in active])
            stats["decode_calls"] += 1
            tokens = [pick(llm.logits(i), s) for s, i in zip(active, last, strict=True)]
            now = clock()
            for s, token in zip(active, tokens, strict=True):
                s.n_past += 1
                emit(s, token, now)
    return stats


def run_llamacpp(workload: dict, args: argparse.Namespace) -> dict:
    why = skip_reason(args.model)
    if why:
        return {"skipped": why}
    reqs = parse_workload(workload)
    kv = getattr(args, "llamacpp_kv", "split")
    plan = Plan.for_requests(reqs, kv)
    threads = args.threads or os.cpu_count() or 1
    t_load = time.monotonic()
    llm = BatchedLlama(model_path(args.model), plan, threads, kv,
                       getattr(args, "llamacpp_flash_attn", "auto"))
    try:
        load_s = time.monotonic() - t_load
        clock = time.monotonic
        serve(llm, [Req("warmup", WARMUP_PROMPT, WARMUP_TOKENS, 0.0, None)], clock, clock(), 1)
        llm.clear()
        t0 = clock()
        stats = serve(llm, reqs, clock, t0, plan.n_seq)
        info = llm.info
    finally:
        llm.close()
    result = summarize(reqs, t0)
    result.update({"load_s": load_s, "prefix_hit_rate": None,
                   "llamacpp": info | stats | {"api": "llama_batch + llama_decode (batched)",
                                               "version": _version()},
                   "requests": request_results(reqs, t0)})
    return result


def _version() -> str | None:
    try:
        import llama_cpp

        return getattr(llama_cpp, "__version__", None)
    except ImportError:  # pragma: no cover - skip_reason checked it
        return None

