"""Structured output's cost (issue 32): `python -m engine_proc.bench.structured [--tokens 64]`.

Decode tokens/s of the default model with a JSON-schema grammar against without, at 1 and 16
streams, in one run (same process, same warm engine, runs interleaved), and the grammar compile
time of engine_proc/bench/schemas.py's 20 schemas on the model's tokenizer (xgrammar, its cache
off). Decode steps only: each stream is admitted and has its first token before timing starts,
and a step's time includes filling and applying the masks and consuming the tokens. The grammar
is an array of `--tokens` integers, so a constrained stream runs as long as an unconstrained one
(`ignore_eos`) and both finish by length."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import xgrammar as xgr

from engine_proc.bench.schemas import SCHEMAS
from engine_proc.config import EngineConfig
from engine_proc.engine.llm_engine import LLMEngine
from engine_proc.sampling_params import SamplingParams
from engine_proc.structured.grammar import compile_constraint, tokenizer_info
from ipc.messages import StructuredOutput

PROMPT = "List some numbers between 0 and 999 as JSON."


def decode_rate(engine: LLMEngine, streams: int, tokens: int, constrained: bool) -> float:
    """Decode tokens/s over the steps where every stream has its first token."""
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
              "minItems": tokens, "maxItems": tokens}  # fmt: skip
    so = StructuredOutput(kind="json", spec=json.dumps(schema), field="bench")
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=not constrained,
                            structured=so if constrained else None)  # fmt: skip
    prompt = engine.tokenize([{"role": "user", "content": PROMPT}])
    for i in range(streams):
        engine.add_request(f"b{i}", prompt, params)
    generated = 0
    elapsed = 0.0
    while engine.has_unfinished_requests():
        started = all(s.num_output_tokens >= 1 for f in engine.requests.values() for s in f)
        t0 = time.perf_counter()
        outs = engine.step()
        if started and engine.structured.parked == {}:
            elapsed += time.perf_counter() - t0
            generated += sum(len(o.new_token_ids) for o in outs)
    return generated / elapsed if elapsed else 0.0


def compile_times(engine: LLMEngine) -> list[float]:
    info = tokenizer_info(engine.tokenizer, engine.model_config.vocab_size, engine.eos_token_ids)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    out = []
    for name, schema in SCHEMAS.items():
        start = time.perf_counter()
        compile_constraint(compiler, "json", json.dumps(schema), name)
        out.append(time.perf_counter() - start)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine_proc.bench.structured")
    ap.add_argument("--tokens", type=int, default=64, help="decode tokens per stream")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--repeats", type=int, default=2, help="interleaved runs of each setting")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's choice)")
    ap.add_argument("--device", default="auto")
    args = ap.parse_args(argv)
    engine = LLMEngine(EngineConfig(num_threads=args.threads, device=args.device,
                                    max_num_seqs=max(args.streams)))  # fmt: skip
    print(f"model {engine.checkpoint_name} on {engine.device}, {args.tokens} tokens a stream")
    decode_rate(engine, 1, 8, True)  # warm-up: the tokenizer info, first steps
    decode_rate(engine, 1, 8, False)
    for streams in args.streams:
        rates: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.repeats):
            for constrained in (False, True):
                rates[constrained].append(decode_rate(engine, streams, args.tokens, constrained))
        plain, grammar = max(rates[False]), max(rates[True])
        print(f"{streams:3d} streams: {plain:8.1f} tok/s without, {grammar:8.1f} tok/s with a "
              f"JSON-schema grammar: {grammar / plain:.2f}x (best of {args.repeats})")  # fmt: skip
    times = compile_times(engine)
    print(f"compile, 20 schemas: total {sum(times) * 1e3:.0f} ms, median "
          f"{statistics.median(times) * 1e3:.1f} ms, max {max(times) * 1e3:.1f} ms")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
