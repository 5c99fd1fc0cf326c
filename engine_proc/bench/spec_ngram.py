"""N-gram speculative decoding's gain (issue 35): `python -m engine_proc.bench.spec_ngram`.

The `spec-ngram` workloads: prompts whose answer repeats the input (summarise-and-quote a
document, edit a piece of code), where prompt lookup has drafts to offer, and a free-text prompt
where it has few. Decode tokens/s of the default model with speculation against without, at 1
and 16 streams, in one run: one engine started with `--speculative-config`, the runs without it
opting out per request (`SamplingParams.speculative=False`), interleaved. Greedy; the texts are
checked equal (speculation is exact). Decode steps only: timing starts once every stream has its
first token. Acceptance from the engine's spec_decode counters. The prompts live in
engine_proc/bench/spec_prompts.py; `python -m app.bench --workloads spec-ngram` runs the same
prompts across systems (llama.cpp and its prompt lookup too).

With `--draft-model PATH` the drafts come from that model instead:
`--draft-model <the default GGUF> --decode-weights dense` serves full-precision replies drafted
by their own 4-bit copy, the one draft-model setting this machine's single model allows."""

from __future__ import annotations

import argparse
import time

from engine_proc.bench.spec_prompts import PROMPTS
from engine_proc.config import EngineConfig
from engine_proc.engine.llm_engine import LLMEngine
from engine_proc.sampling_params import SamplingParams


def run(engine: LLMEngine, prompt: str, streams: int, tokens: int,
        speculative: bool) -> tuple[float, list[str]]:  # fmt: skip
    """Decode tokens/s over the steps where every stream has its first token, and the texts."""
    params = SamplingParams(max_tokens=tokens, temperature=0, speculative=speculative)
    ids = engine.tokenize([{"role": "user", "content": prompt}])
    for i in range(streams):
        engine.add_request(f"s{i}", ids, params)
    generated, elapsed, texts = 0, 0.0, {}
    while engine.has_unfinished_requests():
        started = all(s.num_output_tokens >= 1 for f in engine.requests.values() for s in f)
        t0 = time.perf_counter()
        outs = engine.step()
        if started:
            elapsed += time.perf_counter() - t0
            generated += sum(len(o.new_token_ids) for o in outs)
        for o in outs:
            texts[o.request_id] = o.text
    return (generated / elapsed if elapsed else 0.0), [texts[k] for k in sorted(texts)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine_proc.bench.spec_ngram")
    ap.add_argument("--tokens", type=int, default=128, help="decode tokens per stream")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--k", type=int, default=8, help="num_speculative_tokens (the most a step "
                    "verifies; each sequence's draft length adapts below it)")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved runs of each setting")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's choice)")
    ap.add_argument("--disable-by-batch-size", type=int, default=None,
                    help="no drafts past this many running sequences (0: never; default: the "
                    "engine's)")
    ap.add_argument("--decode-step", default="fused", choices=("eager", "auto", "fused"),
                    help="fused: the C++ decode step the app and serve use on a CPU (built now)")
    ap.add_argument("--decode-weights", default="auto", choices=("auto", "dense", "int4"),
                    help="auto: 4-bit on a CPU, as the app and serve start")
    ap.add_argument("--decode-activations", default="exact", choices=("exact", "int8", "auto"),
                    help="the fused step's arithmetic (EngineConfig.decode_activations)")
    ap.add_argument("--prompts", nargs="+", default=list(PROMPTS), choices=list(PROMPTS))
    ap.add_argument("--draft-model", default=None, metavar="PATH",
                    help="drafts from this model (same tokenizer) instead of prompt lookup; "
                    "the draft runs 4-bit weights where it can, so `--decode-weights dense "
                    "--draft-model` on the default GGUF gives full-precision replies drafted "
                    "by their own 4-bit copy")  # fmt: skip
    ap.add_argument("--model", default=None, help="the target model (default: SmolLM2-135M)")
    args = ap.parse_args(argv)
    spec: dict = {"method": "ngram", "num_speculative_tokens": args.k}
    if args.draft_model is not None:
        spec = {"model": args.draft_model, "num_speculative_tokens": args.k}
    if args.disable_by_batch_size is not None:
        spec["disable_by_batch_size"] = args.disable_by_batch_size
    engine = LLMEngine(EngineConfig(model=args.model, num_threads=args.threads,
                                    max_num_seqs=max(args.streams),
                                    decode_step=args.decode_step,
                                    decode_weights=args.decode_weights,
                                    decode_activations=args.decode_activations,
                                    speculative_config=spec))
    print(f"model {engine.checkpoint_name} on {engine.device}, {args.tokens} tokens a stream, "
          f"{spec}, decode step {args.decode_step}, weights {args.decode_weights}, activations "
          f"{args.decode_activations}")
    run(engine, PROMPTS["free"], 1, 8, True)  # warm-up
    stats = engine.stats.spec_decode
    for name in args.prompts:
        for streams in args.streams:
            rates: dict[bool, list[float]] = {False: [], True: []}
            texts: dict[bool, list[str]] = {}
            drafted0, accepted0 = stats.num_draft_tokens, stats.num_accepted_tokens
            for _ in range(args.repeats):
                for on in (False, True):
                    rate, texts[on] = run(engine, PROMPTS[name], streams, args.tokens, on)
                    rates[on].append(rate)
            drafted = stats.num_draft_tokens - drafted0
            accepted = stats.num_accepted_tokens - accepted0
            plain, fast = max(rates[False]), max(rates[True])
            same = "same text" if texts[False] == texts[True] else "TEXT DIFFERS"
            print(f"{name:10s} {streams:3d} streams: {plain:7.1f} tok/s without, {fast:7.1f} with:"
                  f" {fast / plain:.2f}x; {accepted}/{drafted} drafts accepted; {same} "
                  f"(best of {args.repeats})")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
