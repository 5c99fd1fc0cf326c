"""Terminal chat with the engine: `python -m app chat [--connect ENDPOINT]`.

Without --connect it starts `python -m engine_proc serve` as a child process, waits for its
`KVSCOPE_READY {json}` line (docs/PROTOCOL.md) and stops it on exit. Tokens print as they
arrive; the conversation is kept across turns. Commands: /reset, /stats, /quit (or Ctrl+D).
Ctrl+C during a reply stops that reply; at the prompt it quits.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import threading
from typing import IO, Any

from app.supervisor import (
    APP_DECODE_ACTIVATIONS,
    DECODE_ACTIVATIONS,
    DECODE_ACTIVATIONS_HELP,
    DECODE_WEIGHTS,
    EngineOptions,
    EngineSupervisor,
    engine_command,
)
from ipc import protocol as P
from ipc.client import EngineClient, EngineError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m app chat", description=__doc__.splitlines()[0])
    p.add_argument("--connect", default=None, help="engine ROUTER endpoint (default: start one)")
    p.add_argument("--token", default=None, help="access token (or $KVSCOPE_TOKEN)")
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--cache-salt", default=None)
    p.add_argument("--quiet", action="store_true", help="no stats line after each reply")
    g = p.add_argument_group("engine to start (without --connect)")
    g.add_argument("--model", default=None)
    g.add_argument("--dtype", default=None)
    g.add_argument("--device", default=None)
    g.add_argument(
        "--decode-weights",
        default="auto",
        choices=DECODE_WEIGHTS,
        help="int4: 4-bit weight copies for decode on CPU (~2x faster replies); dense: the "
        "model's own precision; auto (default): int4 on a CPU, dense on a GPU",
    )
    g.add_argument("--decode-activations", default=APP_DECODE_ACTIVATIONS,
                   choices=DECODE_ACTIVATIONS,
                   help=DECODE_ACTIVATIONS_HELP)
    g.add_argument(
        "--engine-args", default="", help='more `serve` options, e.g. "--num-blocks 512"'
    )
    g.add_argument("--startup-timeout", type=float, default=600.0)
    return p


def start_engine(options: EngineOptions, timeout: float, log: IO[str]) -> EngineSupervisor:
    """Spawn `python -m engine_proc serve` (through the GUI's supervisor) and wait for its
    KVSCOPE_READY line, reporting KVSCOPE_PROGRESS on `log`."""
    settled = threading.Event()

    def progress(fraction: float, message: str) -> None:
        log.write(f"\r[engine {fraction * 100:5.1f}%] {message[:60]:<60}")
        log.flush()

    engine = EngineSupervisor(
        engine_command(options),
        on_progress=progress,
        on_ready=lambda _info: settled.set(),
        on_exit=lambda _code: settled.set(),
    )
    engine.start()
    settled.wait(timeout)
    log.write("\n")
    if engine.ready_info is None:
        engine.stop()
        tail = "\n".join(engine.tail(10))
        raise RuntimeError(f"the engine did not get ready (exit code {engine.proc.poll()})\n{tail}")
    return engine


def _stats_line(finish: P.Finish) -> str:
    u = finish.usage
    parts = [
        f"prompt {u.prompt_tokens} (cached {u.cached_tokens})",
        f"{u.completion_tokens} tokens",
    ]
    if finish.ttft is not None:
        parts.append(f"TTFT {finish.ttft * 1000:.0f} ms")
    if finish.tpot:
        parts.append(f"{1.0 / finish.tpot:.1f} tok/s")
    parts.append(finish.reason + (f": {finish.error}" if finish.error else ""))
    return "[" + " | ".join(parts) + "]"


def chat_loop(
    client: EngineClient, args: argparse.Namespace, stdin: IO[str], stdout: IO[str]
) -> int:
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    sampling = dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    interactive = stdin.isatty()
    while True:
        if interactive:
            stdout.write("you> ")
            stdout.flush()
        try:
            line = stdin.readline()
        except KeyboardInterrupt:
            stdout.write("\n")
            return 0
        if not line:
            return 0
        text = line.rstrip("\n")
        if not text.strip():
            continue
        if text.strip() in ("/quit", "/exit"):
            return 0
        if text.strip() == "/reset":
            history = history[:1] if args.system else []
            stdout.write("[conversation cleared]\n")
            continue
        if text.strip() == "/stats":
            cfg = client.get_config()
            m = client.model_info
            stdout.write(
                f"[{m.name} on {m.device} ({m.dtype}), {m.num_blocks} blocks x "
                f"{m.block_size} tokens; max_num_seqs {cfg.max_num_seqs}, "
                f"max_num_batched_tokens {cfg.max_num_batched_tokens}, long_prefill_chunk "
                f"{cfg.long_prefill_chunk}, prefix caching "
                f"{'on' if cfg.enable_prefix_caching else 'off'}"
                f"{', paused' if cfg.paused else ''}]\n"
            )
            continue
        history.append({"role": "user", "content": text})
        reply = _one_turn(client, history, sampling, args, stdout)
        if reply is None:
            history.pop()
        else:
            history.append({"role": "assistant", "content": reply})


def _one_turn(
    client: EngineClient,
    history: list[dict[str, str]],
    sampling: dict[str, Any],
    args: argparse.Namespace,
    stdout: IO[str],
) -> str | None:
    stdout.write("assistant> ")
    stdout.flush()
    try:
        stream = client.chat(history, cache_salt=args.cache_salt, **sampling)
    except EngineError as exc:
        stdout.write(f"\n[error: {exc}]\n")
        return None
    try:
        try:
            for ev in stream:
                if isinstance(ev, P.Delta):
                    stdout.write(ev.text)
                    stdout.flush()
        except KeyboardInterrupt:
            stream.abort()
            for _ in stream:  # let the abort's finish arrive
                pass
    except EngineError as exc:
        stdout.write(f"\n[error: {exc}]\n")
        return None
    stdout.write("\n")
    if stream.finish is not None and not args.quiet:
        stdout.write(_stats_line(stream.finish) + "\n")
    stdout.flush()
    return stream.text


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    token = args.token or os.environ.get("KVSCOPE_TOKEN") or None
    engine: EngineSupervisor | None = None
    endpoint = args.connect
    if endpoint is None:
        options = EngineOptions(
            model=args.model,
            dtype=args.dtype,
            device=args.device,
            decode_weights=args.decode_weights,
            decode_activations=args.decode_activations,
            client_timeout=None,  # the server's own default
            extra_args=["--log-level", "WARNING", *shlex.split(args.engine_args)],
        )
        try:
            engine = start_engine(options, args.startup_timeout, sys.stderr)
        except RuntimeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        endpoint = engine.ready_info["endpoint"]
    try:
        try:
            client = EngineClient(endpoint, token=token, client_name="terminal-chat")
        except EngineError as exc:
            print(f"error: cannot reach the engine at {endpoint}: {exc}", file=sys.stderr)
            return 1
        try:
            m = client.model_info
            print(f"[connected to {m.name} on {m.device}; /reset, /stats, /quit]", file=sys.stderr)
            return chat_loop(client, args, sys.stdin, sys.stdout)
        finally:
            client.close()
    finally:
        if engine is not None:
            engine.stop(timeout=15.0)


if __name__ == "__main__":
    sys.exit(main())
