"""The benchmark's workloads: pure functions of (sizes, seed, vocabulary), written as JSON.

Every system of a workload reads the very same JSON (token ids, output lengths, arrival times),
so none gets easier inputs. Token ids are drawn from the model's ordinary vocabulary, which the
driver learns from the `ceilings` worker (this module never imports torch).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from app.bench.kv_workloads import KV_BUILDERS, KV_GROUPS, KV_WORKLOAD_SYSTEMS, KV_WORKLOADS
from app.bench.spec_workloads import (
    SPEC_LEVELS,
    SPEC_WORKLOAD_SYSTEMS,
    SPEC_WORKLOADS,
    build_spec,
    spec_group,
    spec_level,
)
from app.supervisor import APP_DECODE_ACTIVATIONS

# N concurrent greedy streams, all arriving at once, for N in Sizes.streams_levels: one workload
# per N (each its own fresh process per system, like every workload), `streams` names them all.
STREAMS_LEVELS = (1, 4, 16, 64)
STREAMS_WORKLOADS = tuple(f"streams-{n}" for n in STREAMS_LEVELS)
WORKLOADS = ("single", "prefill", "mixed", "mixed-poisson", "shared-prefix", "interference",
             "streaming", *STREAMS_WORKLOADS, *KV_WORKLOADS, *SPEC_WORKLOADS)
# Which systems each workload compares (llamacpp only where it is a like-for-like serving test).
WORKLOAD_SYSTEMS = {
    "single": ("kvscope", "kvscope-int4", "hf", "llamacpp"),
    "prefill": ("kvscope", "hf", "llamacpp"),
    "mixed": ("kvscope", "hf", "llamacpp"),
    "mixed-poisson": ("kvscope", "hf"),
    "shared-prefix": ("kvscope", "kvscope-nocache"),
    "interference": ("kvscope", "kvscope-nochunk"),
    # The engine process behind its two front-ends, driven by app.bench.clients.
    "streaming": ("kvscope-zmq", "kvscope-http"),
    # kvscope runs the app's arithmetic (STREAMS_DECODE_ACTIVATIONS), kvscope-exact the same
    # engine on float32 activations (EngineConfig.decode_activations)
    **{w: ("kvscope", "kvscope-exact", "hf", "llamacpp") for w in STREAMS_WORKLOADS},
    # KVScope configurations only (app/bench/kv_workloads.py).
    **KV_WORKLOAD_SYSTEMS,
    # Speculative decoding against none, and llama.cpp's own prompt lookup
    # (app/bench/spec_workloads.py).
    **SPEC_WORKLOAD_SYSTEMS,
}
# kvscope's decode weights in the streams workloads: what the app runs on a CPU by default
# (`auto`: 4-bit copies for steps of at most 16 tokens where supported, else dense).
STREAMS_DECODE_WEIGHTS = "auto"
# ...and its arithmetic: the app's (8-bit activations where our 4-bit kernels run)
STREAMS_DECODE_ACTIVATIONS = APP_DECODE_ACTIVATIONS
# ...and the decode step the app uses with them (engine_proc/executor/fused_decode.py; built once,
# cached)
STREAMS_DECODE_STEP = "fused"


@dataclass(slots=True)
class Sizes:
    single_prompt: int = 128
    single_new: int = 256
    prefill_len: int = 1000
    prefill_reps: int = 3
    mixed_n: int = 64
    mixed_prompt: tuple[int, int] = (32, 1024)
    mixed_out: tuple[int, int] = (16, 256)
    poisson_rate: float = 1.0  # requests per second
    shared_n: int = 32
    shared_prefix: int = 1024
    shared_user: int = 32
    shared_out: int = 8
    interf_streams: int = 8
    interf_long: int = 2000
    interf_chunk: int = 32  # long_prefill_chunk of the chunked run (CPU-sized, see --help)
    interf_warm: int = 8  # decode tokens each stream has before the long prompt arrives
    interf_tail: int = 8  # decode steps after the long prompt's chunks
    streams_n: int = 32  # concurrent streams, all arriving at once
    streams_prompt: tuple[int, int] = (56, 72)  # prompt length range (~64 tokens)
    streams_out: int = 128  # new tokens per stream (greedy, EOS ignored)
    # the streams-N workloads (N concurrent greedy streams)
    streams_levels: tuple[int, ...] = STREAMS_LEVELS  # which N `--workloads streams` runs
    streams_len: int = 29  # prompt tokens of every stream (the table)
    streams_new: int = 128  # new tokens of every stream, EOS ignored
    # KV tiers and int8 KV (app/bench/kv_workloads.py); sized so that each ratio shows within a
    # minute or two on 2 cores (LONG: the 2,000-token version, about 10x the time)
    tiered_prompts: int = 6  # distinct system prompts in rotation
    tiered_len: int = 1024  # tokens of each system prompt
    tiered_pool_prompts: int = 2  # the pool holds this many requests
    tiered_requests: int = 12  # the first rotation computes; the rest are measured
    tiered_user: int = 8  # each request's own user turn (under one KV block)
    tiered_out: int = 1
    restart_prompts: int = 2
    restart_len: int = 1024
    kvcap_memory: int = 32 * 2**20  # the fixed kv_cache_memory of both KV dtypes
    kvcap_seqs: int = 24  # more than int8 KV holds at once for the default model
    kvcap_prompt: int = 120
    kvcap_new: int = 8
    kv4k_prompt: int = 4064  # decode from 4,064 to 4,096 tokens of context
    kv4k_new: int = 32
    kv4k_memory: int = 256 * 2**20  # the engine's default pool bytes
    # the spec-ngram-N / spec-draft-N workloads (app/bench/spec_workloads.py)
    spec_levels: tuple[int, ...] = SPEC_LEVELS  # which N `--workloads spec-ngram` runs
    spec_new: int = 128  # new tokens of every stream, greedy, EOS ignored
    hf_batch: int = 8


FULL = Sizes()
LONG = Sizes(tiered_prompts=16, tiered_len=2000, tiered_pool_prompts=4, tiered_requests=24,
             restart_len=2000)
QUICK = Sizes(
    single_prompt=32, single_new=32, prefill_len=256, prefill_reps=2,
    mixed_n=12, mixed_prompt=(16, 64), mixed_out=(4, 16), poisson_rate=4.0,
    shared_n=4, shared_prefix=512, shared_user=16, shared_out=2,
    interf_streams=4, interf_long=256, interf_chunk=32, interf_warm=4, interf_tail=4,
    streams_out=32,  # still 32 streams: the HTTP target is about that many at once
    streams_levels=(1, 4, 16), streams_new=32,
    tiered_prompts=6, tiered_len=256, tiered_pool_prompts=2, tiered_requests=9,
    restart_prompts=1, restart_len=256, kvcap_seqs=24, kv4k_prompt=1008, kv4k_new=16,
    spec_new=64,
    hf_batch=4,  # three static batches for twelve requests, like 64 requests in batches of 8
)


def streams_level(name: str) -> int | None:
    """N of a streams-N workload name, else None."""
    prefix, _, n = name.partition("-")
    return int(n) if prefix == "streams" and n.isdigit() else None


def expand_workloads(names: list[str], sizes: Sizes) -> list[str]:
    """`--workloads` names with `streams` replaced by the streams-N workloads of `sizes`,
    `spec-ngram` / `spec-draft` by their N workloads and `kv-int8` by the int8 KV workloads;
    raises ValueError naming unknown ones."""
    out: list[str] = []
    for name in names:
        group = [f"streams-{n}" for n in sizes.streams_levels] if name == "streams" else [name]
        group = spec_group(name, sizes.spec_levels) or list(KV_GROUPS.get(name, group))
        for w in group:
            if w not in WORKLOADS:
                raise ValueError(f"unknown workload {w!r}; allowed: {', '.join(WORKLOADS)}, "
                                 "streams (the streams-N workloads), spec-ngram and spec-draft "
                                 "(their N workloads) and kv-int8 "
                                 f"({' '.join(KV_GROUPS['kv-int8'])})")
            if w not in out:
                out.append(w)
    return out


def default_workloads(sizes: Sizes) -> list[str]:
    """Every workload, the streams-N and spec ones at the levels of `sizes`."""
    plain = [w for w in WORKLOADS if streams_level(w) is None and spec_level(w) is None]
    return expand_workloads(plain + ["streams", "spec-ngram", "spec-draft"], sizes)


class Vocab:
    """Ordinary token ids: [0, vocab_size) without the special / added ones; and the token ids
    of the real chat prompts (`prompts`, by kind) the spec workloads serve."""

    def __init__(self, vocab_size: int, special_ids: list[int],
                 prompts: dict[str, list[int]] | None = None) -> None:
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        self.prompts = dict(prompts or {})
        self.special = set(special_ids)
        self.low = max(self.special) + 1 if self.special else 0
        self.size = vocab_size

    def draw(self, rng: random.Random, n: int) -> list[int]:
        out = []
        while len(out) < n:
            t = rng.randrange(self.low, self.size)
            if t not in self.special:
                out.append(t)
        return out


def _request(rid: str, prompt: list[int], max_tokens: int, **when: Any) -> dict:
    return {"id": rid, "prompt": prompt, "max_tokens": max_tokens, **when}


def make_workload(name: str, sizes: Sizes, seed: int, vocab: Vocab,
                  draft_model: str | None = None) -> dict:
    """The workload `name` as the JSON the worker reads; same inputs, same output.
    `draft_model`: the draft model path of the spec-draft workloads."""
    if name not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {name!r}")
    # One stream per workload name, so changing one workload's sizes leaves the others alone.
    rng = random.Random(f"{seed}:{name}")
    s = sizes
    engine: dict[str, Any] = {}
    meta: dict[str, Any] = {}
    hf_batch = s.hf_batch
    if name == "single":
        reqs = [_request("r0", vocab.draw(rng, s.single_prompt), s.single_new, arrival_s=0.0)]
    elif name == "prefill":
        reqs = [_request(f"p{i}", vocab.draw(rng, s.prefill_len), 1,
                         **({"arrival_s": 0.0} if i == 0 else
                            {"after": {"request": f"p{i - 1}", "tokens": -1}}))
                for i in range(s.prefill_reps)]
    elif name in ("mixed", "mixed-poisson"):
        rng = random.Random(f"{seed}:mixed")  # both variants serve the very same requests
        reqs = [_request(f"m{i}", vocab.draw(rng, rng.randint(*s.mixed_prompt)),
                         rng.randint(*s.mixed_out), arrival_s=0.0) for i in range(s.mixed_n)]
        if name == "mixed-poisson":
            arrivals = random.Random(f"{seed}:arrivals")
            t = 0.0
            for r in reqs:
                r["arrival_s"] = round(t, 6)
                t += arrivals.expovariate(s.poisson_rate)
            meta["rate"] = s.poisson_rate
    elif name == "shared-prefix":
        prefix = vocab.draw(rng, s.shared_prefix)
        reqs = [_request(f"c{i}", prefix + vocab.draw(rng, s.shared_user), s.shared_out,
                         **({"arrival_s": 0.0} if i == 0 else
                            {"after": {"request": f"c{i - 1}", "tokens": -1}}))
                for i in range(s.shared_n)]
        meta["shared_prefix"] = s.shared_prefix
    elif name == "interference":
        chunk_steps = -(-s.interf_long // s.interf_chunk)
        decode_len = s.interf_warm + chunk_steps + s.interf_tail
        reqs = [_request(f"d{i}", vocab.draw(rng, 32), decode_len, arrival_s=0.0)
                for i in range(s.interf_streams)]
        reqs.append(_request("long", vocab.draw(rng, s.interf_long), 1,
                             after={"request": "d0", "tokens": s.interf_warm}))
        engine = {"long_prefill_chunk": s.interf_chunk,
                  "max_num_batched_tokens": max(2048, s.interf_chunk + s.interf_streams)}
        meta["long_id"] = "long"
    elif streams_level(name) is not None:
        n = streams_level(name)
        rng = random.Random(f"{seed}:streams")  # streams-4's prompts begin streams-16's
        reqs = [_request(f"s{i}", vocab.draw(rng, s.streams_len), s.streams_new, arrival_s=0.0)
                for i in range(n)]
        engine = {"decode_weights": STREAMS_DECODE_WEIGHTS, "decode_step": STREAMS_DECODE_STEP,
                  "decode_activations": STREAMS_DECODE_ACTIVATIONS}
        meta.update(streams=n, decode_weights=STREAMS_DECODE_WEIGHTS,
                    decode_activations=STREAMS_DECODE_ACTIVATIONS)
        hf_batch = n  # transformers serves all N in one static batch (no padding: same length)
    elif name in KV_BUILDERS:
        reqs, engine, meta = KV_BUILDERS[name](s, rng, vocab)
    elif spec_level(name) is not None:  # real text, no draws from rng
        reqs, engine, meta = build_spec(name, vocab.prompts, s.spec_new, draft_model)
    else:  # streaming
        reqs = [_request(f"s{i}", vocab.draw(rng, rng.randint(*s.streams_prompt)),
                         s.streams_out, arrival_s=0.0) for i in range(s.streams_n)]
        # Shorter than one KV block, so the warm-up leaves nothing the prefix cache could hit.
        meta["warmup_prompt"] = vocab.draw(rng, 8)
    return {"name": name, "seed": seed, "requests": reqs, "engine": engine,
            "hf_batch": hf_batch, "meta": meta}
