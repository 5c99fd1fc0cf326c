"""`python -m engine_proc serve`: options, engine construction, start-up lines, signals.

The socket loop itself is engine_proc/server/engine_server.py; this module turns a command line into
a running EngineServer and prints the start-up lines of docs/PROTOCOL.md section 3."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import signal
import sys
import time
from typing import Any

import zmq

from engine_proc.config import (
    SUPPORTED_DTYPES,
    add_kernel_arguments,
    add_kv_tier_arguments,
    kernel_options,
    kv_tier_options,
)
from engine_proc.server.config import ServerConfig
from engine_proc.server.disagg import ROLES, TRANSFER_FAILURE_POLICIES, DisaggConfig
from engine_proc.server.engine_server import EngineServer
from ipc import endpoints as E
from ipc import protocol as P
from ipc.vllm_events.config import kv_events_config_arg

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `serve` options (shared by `python -m engine_proc serve` and this module)."""
    g = parser.add_argument_group("model and engine")
    g.add_argument(
        "--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M)"
    )
    g.add_argument("--dtype", default="float32", choices=SUPPORTED_DTYPES)
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    g.add_argument(
        "--num-blocks",
        "--num-kv-blocks",
        dest="num_blocks",
        type=int,
        default=None,
        help="KV blocks in the pool (default: from --kv-cache-memory)",
    )
    g.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for the K/V pool")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--long-prefill-chunk", type=int, default=None)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument(
        "--hybrid-kv",
        choices=("auto", "on", "off"),
        default="auto",
        help="release the KV blocks that leave a sliding window (Gemma, Mistral, Phi-3): on; off "
        "keeps every block; auto (default): on unless KV tiers (or fp8 KV on a model with full "
        "and sliding layers) need every block",
    )
    g.add_argument("--num-threads", type=int, default=None, help="torch threads on CPU")
    add_kernel_arguments(g)
    add_kv_tier_arguments(g)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='speculative decoding, vLLM\'s shape: prompt lookup \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' or a '
        'draft model with the same tokenizer \'{"model": PATH, "num_speculative_tokens": 4}\'',
    )
    g.add_argument("--engine-factory", default=None, help=argparse.SUPPRESS)  # "module:callable"
    s = parser.add_argument_group("serving")
    s.add_argument(
        "--endpoint",
        default=E.DEFAULT_ENDPOINT,
        help="ROUTER bind address (tcp://127.0.0.1:PORT, '*' = free port; ipc://auto)",
    )
    s.add_argument("--pub-endpoint", default=E.DEFAULT_PUB_ENDPOINT, help="PUB bind address")
    s.add_argument("--telemetry-hz", type=float, default=20.0)
    s.add_argument("--heartbeat-interval", type=float, default=P.DEFAULT_HEARTBEAT_INTERVAL)
    s.add_argument(
        "--client-timeout",
        type=float,
        default=P.DEFAULT_CLIENT_TIMEOUT,
        help="seconds of client silence before its requests are aborted",
    )
    s.add_argument("--max-pending", type=int, default=4096)
    s.add_argument(
        "--no-kv-events",
        dest="kv_events",
        action="store_false",
        help="do not publish KV cache events (PUB topic kv_events; the window's prefix tree)",
    )
    s.add_argument(
        "--kv-events-config",
        type=kv_events_config_arg,
        default=None,
        metavar="JSON",
        help="also publish KV cache events in vLLM's wire format, for KV-aware routers: vLLM's "
        "--kv-events-config JSON, e.g. '{\"enable_kv_cache_events\": true}' (docs/PROTOCOL.md, "
        "\"KV events in vLLM's format\")",
    )
    s.add_argument(
        "--allow-remote",
        action="store_true",
        help="allow non-loopback binds (needs --token or $KVSCOPE_TOKEN)",
    )
    s.add_argument(
        "--token",
        default=None,
        help="access token every message must carry "
        "(prefer $KVSCOPE_TOKEN: command lines are visible to other users)",
    )
    s.add_argument("--log-level", default="INFO")
    d = parser.add_argument_group("prefill/decode disaggregation (docs/PROTOCOL.md section 10)")
    d.add_argument("--role", default="", choices=ROLES[1:],
                   help="serve one half of a disaggregated pair (default: whole requests)")
    d.add_argument("--kv-transfer-endpoint", default="tcp://127.0.0.1:*",
                   help="prefill role: where decode engines pull KV blocks")
    d.add_argument("--kv-lease-seconds", type=float, default=30.0,
                   help="prefill role: how long a finished prompt's blocks wait to be pulled")
    d.add_argument("--kv-transfer-timeout", type=float, default=10.0,
                   help="decode role: seconds a pull may take before it counts as failed")
    d.add_argument("--kv-transfer-failure", default="recompute", choices=TRANSFER_FAILURE_POLICIES,
                   help="decode role: what a failed pull does (default: recompute the prompt)")
    d.add_argument("--kv-transfer-fault", default="", help=argparse.SUPPRESS)  # tests: drop|corrupt


def _progress(fraction: float, message: str) -> None:
    print(f"{P.PROGRESS_PREFIX} {fraction:.2f} {message}", flush=True)


class _Progress:
    """Loader progress (0..1) -> KVSCOPE_PROGRESS lines, at most one per percent."""

    def __init__(self, low: float, high: float) -> None:
        self.low, self.high, self.last = low, high, -1.0

    def __call__(self, fraction: float, message: str) -> None:
        value = self.low + (self.high - self.low) * min(max(float(fraction), 0.0), 1.0)
        if value - self.last >= 0.01 or fraction >= 1.0:
            self.last = value
            _progress(value, message.replace("\n", " "))


def build_engine(args: argparse.Namespace) -> Any:
    if args.engine_factory:
        module, _, name = args.engine_factory.partition(":")
        return getattr(importlib.import_module(module), name)(args)
    from engine_proc import EngineConfig, LLMEngine

    kwargs: dict[str, Any] = dict(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        num_kv_blocks=args.num_blocks,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        hybrid_kv={"auto": None, "on": True, "off": False}[getattr(args, "hybrid_kv", "auto")],
        seed=args.seed,
        num_threads=args.num_threads,
        speculative_config=getattr(args, "speculative_config", None),
        **kernel_options(args),
        **kv_tier_options(args),
    )
    for name in ("kv_cache_memory", "max_num_seqs", "max_num_batched_tokens", "long_prefill_chunk"):
        if getattr(args, name) is not None:
            kwargs[name] = getattr(args, name)
    return LLMEngine(EngineConfig(**kwargs), progress=_Progress(0.05, 0.9))


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    token = args.token or os.environ.get("KVSCOPE_TOKEN") or None
    try:
        cfg = ServerConfig(
            endpoint=args.endpoint,
            pub_endpoint=args.pub_endpoint,
            telemetry_hz=args.telemetry_hz,
            heartbeat_interval=args.heartbeat_interval,
            client_timeout=args.client_timeout,
            allow_remote=args.allow_remote,
            token=token,
            max_pending=args.max_pending,
            kv_events=args.kv_events,
            vllm_events=args.kv_events_config,
            disagg=DisaggConfig(
                role=args.role,
                transfer_endpoint=args.kv_transfer_endpoint,
                lease_seconds=args.kv_lease_seconds,
                transfer_timeout=args.kv_transfer_timeout,
                transfer_failure=args.kv_transfer_failure,
                fault=args.kv_transfer_fault,
            ),
        )
    except ValueError as exc:
        log.error("%s", exc)
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2

    stop: list[str] = []
    server: EngineServer | None = None

    def on_signal(signum: int, frame: object) -> None:
        why = f"received {signal.Signals(signum).name}"
        stop.append(why)
        if server is not None:
            server.request_stop(why)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        _progress(0.0, "starting")
        _progress(0.05, "loading model")
        t0 = time.monotonic()
        try:
            engine = build_engine(args)
        except (ValueError, FileNotFoundError, OSError) as exc:
            log.error("could not start the engine: %s", exc)
            print(f"error: {exc}", file=sys.stderr, flush=True)
            return 1
        log.info("engine ready in %.1f s", time.monotonic() - t0)
        if stop:
            return 0
        _progress(0.95, "binding sockets")
        server = EngineServer(engine, cfg)
        try:
            endpoint, pub_endpoint = server.bind()
        except ValueError as exc:  # e.g. a transfer endpoint that is not loopback
            log.error("could not bind: %s", exc)
            print(f"error: {exc}", file=sys.stderr, flush=True)
            server.close()
            return 2
        except zmq.ZMQError as exc:
            log.error("could not bind: %s", exc)
            print(f"error: could not bind: {exc}", file=sys.stderr, flush=True)
            server.close()
            return 1
        if stop:
            server.request_stop(stop[0])
        _progress(1.0, "ready")
        ready = {
            "endpoint": endpoint,
            "pub_endpoint": pub_endpoint,
            "protocol_version": P.PROTOCOL_VERSION,
            "pid": os.getpid(),
            "model": server._model_info.name if server._model_info else None,
        }
        if server.disagg is not None:
            ready |= {"role": args.role, "kv_transfer_endpoint": server.disagg.transfer_endpoint}
        if server.vllm_events is not None:  # where a '*' bound (vLLM-format KV events)
            ready |= {"kv_events_endpoint": server.vllm_events.endpoint,
                      "kv_events_replay_endpoint": server.vllm_events.replay_endpoint or None}
        print(f"{P.READY_PREFIX} {json.dumps(ready)}", flush=True)
        log.info("serving on %s (telemetry %s)", endpoint, pub_endpoint)
        rc = server.serve_forever()
        flush = getattr(engine, "flush_kv_tiers", None)
        if flush is not None:  # the pool's cached prefixes go to disk before the process ends
            try:
                log.info("KV tiers: %d cached blocks written down", flush())
            except Exception:  # never turn a clean stop into a crash
                log.warning("KV tiers: flush at shutdown failed", exc_info=True)
        return rc
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine_proc.server", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
