"""`python -m engine_proc generate ...` (one completion in the terminal),
`python -m engine_proc serve ...` (the engine process behind the desktop app) and
`python -m engine_proc models ...` (the models on this machine: engine_proc/catalog/cli.py)."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from engine_proc.config import SUPPORTED_DTYPES, add_kernel_arguments, kernel_options


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="complete one prompt and print timing")
    p.add_argument("--prompt", required=True, help="prompt text (a user message with --chat)")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--model", default=None, help="HF directory or .gguf file (default: SmolLM2)")
    p.add_argument("--dtype", default="float32", choices=SUPPORTED_DTYPES)
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' or '
                   '\'{"model": PATH, "num_speculative_tokens": 4}\'')  # fmt: skip
    add_kernel_arguments(p)
    p.add_argument("--log-level", default="WARNING")


def run_generate(args: argparse.Namespace) -> int:
    from engine_proc import EngineConfig, LLMEngine, SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            device=args.device,
            num_threads=args.threads,
            speculative_config=args.speculative_config,
            **kernel_options(args),
        ),
        progress=_print_progress,
    )
    print(file=sys.stderr)
    if args.chat:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        prompt: str | list[dict[str, str]] = messages + [{"role": "user", "content": args.prompt}]
    else:
        prompt = args.prompt
    engine.add_request("cli", prompt, params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            print(out.text_delta, end="", flush=True)
            if out.finished:
                final = out
    assert final is not None and final.metrics is not None
    m = final.metrics
    n = len(final.token_ids)
    decode_tps = 1 / m.tpot if m.tpot is not None else float("nan")
    print()
    print(
        f"[prompt {final.num_prompt_tokens} tokens | TTFT {m.ttft * 1000:.1f} ms | "
        f"{n} tokens, decode {decode_tps:.1f} tok/s | finish: {final.finish_reason}]"
    )
    spec = engine.stats.spec_decode
    if spec.num_drafts:
        print(f"[speculative: {spec.num_accepted_tokens}/{spec.num_draft_tokens} drafts accepted "
              f"({spec.num_accepted_tokens / spec.num_draft_tokens:.0%}) over {spec.num_drafts} "
              f"steps; accepted by position {spec.num_accepted_tokens_per_pos}]")  # fmt: skip
    return 0


def _print_progress(fraction: float, message: str) -> None:
    print(
        f"\rloading {fraction * 100:5.1f}% {message[:60]:<60}", end="", file=sys.stderr, flush=True
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "models":  # before the server's imports: this path has no torch
        from engine_proc.catalog.cli import main as models_main

        return models_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m engine_proc", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    serve = sub.add_parser("serve", help="run the engine process (ZeroMQ server)")
    try:
        from engine_proc.server import cli as server
    except ImportError as exc:  # keep `generate` usable if the server cannot load
        server = None
        serve.set_defaults(_server_error=str(exc))
    else:
        server.add_arguments(serve)
    args = parser.parse_args(argv)
    if args.command == "generate":
        logging.basicConfig(
            level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s"
        )
        start = time.monotonic()
        try:
            return run_generate(args)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        finally:
            logging.getLogger(__name__).info("done in %.1f s", time.monotonic() - start)
    if server is None:
        print(f"error: the server is unavailable: {args._server_error}", file=sys.stderr)
        return 2
    return server.run(args)


if __name__ == "__main__":
    sys.exit(main())
