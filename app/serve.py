"""`kvscope serve` / `python -m app serve`: an OpenAI-compatible HTTP server for the engine.

Without --connect it spawns `python -m engine_proc serve` (the GUI's supervisor, with load
progress on the terminal) and serves HTTP at once: /health answers 503 while the model loads.
With --connect tcp://... it fronts an engine that is already running (and reattaches when that
engine comes back after going away).

    python -m app serve --port 8000
    curl -s localhost:8000/v1/chat/completions -H 'content-type: application/json' \
        -d '{"messages": [{"role": "user", "content": "Hi!"}]}'
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
import sys
from typing import Any

from app.api.keeper import EngineKeeper
from app.api.server import EngineLink, create_app
from app.api.settings import ServerSettings, is_loopback_host
from app.api.tools import ALIASES, FAMILIES
from app.router.deployment import DisaggKeeper, DisaggLink
from app.supervisor import (
    APP_DECODE_ACTIVATIONS,
    DECODE_ACTIVATIONS,
    DECODE_ACTIVATIONS_HELP,
    DECODE_WEIGHTS,
    DTYPES,
    KV_CACHE_DTYPES,
)
from ipc.vllm_events.config import kv_events_json_arg

log = logging.getLogger("app.serve")

MIN_REMOTE_KEY_LENGTH = 16
EXIT_BAD_OPTIONS = 2


TOOL_PARSERS = sorted({*FAMILIES, *ALIASES})


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvscope serve", description="OpenAI-compatible HTTP API and Prometheus metrics."
    )
    h = p.add_argument_group("HTTP")
    h.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    h.add_argument("--port", type=int, default=8000, help="0 = any free port")
    h.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="key clients must send as 'Authorization: Bearer KEY' (repeatable; or "
        "$KVSCOPE_API_KEY). Required (>= 16 characters) for a non-loopback --host",
    )
    h.add_argument("--served-model-name", nargs="+", default=None, help="model ids to answer to")
    h.add_argument("--max-pending", type=int, default=256, help="API calls in flight (then 429)")
    h.add_argument("--max-body-bytes", type=int, default=1 << 20)
    h.add_argument("--max-n", type=int, default=16, help="largest n (choices per request)")
    h.add_argument("--max-tokens", type=int, default=None, help="cap (default: max_model_len)")
    h.add_argument("--tool-call-parser", default=None, choices=TOOL_PARSERS,
                   help="how tool calls are read from replies (default: the chat template's "
                   "family, hermes for templates without tools)")  # fmt: skip
    h.add_argument("--cors-origin", action="append", default=[], help="allow this origin (CORS)")
    h.add_argument(
        "--allowed-host", action="append", default=[], help="extra Host header name on loopback"
    )
    e = p.add_argument_group("engine")
    e.add_argument("--connect", default=None, help="engine ROUTER endpoint (default: spawn one)")
    e.add_argument("--token", default=None, help="engine access token (or $KVSCOPE_TOKEN)")
    e.add_argument("--model", default=None,
                   help="GGUF file, HF directory or a name `kvscope models` lists")  # fmt: skip
    e.add_argument("--dtype", default=None, choices=DTYPES)
    e.add_argument("--device", default=None, help="auto | cpu | cuda | cuda:N")
    e.add_argument("--num-kv-blocks", type=int, default=None)
    e.add_argument("--max-model-len", type=int, default=None)
    e.add_argument(
        "--decode-weights",
        default="auto",
        choices=DECODE_WEIGHTS,
        help="auto (default): 4-bit decode weights on a CPU, dense on a GPU",
    )
    e.add_argument("--decode-activations", default=APP_DECODE_ACTIVATIONS,
                   choices=DECODE_ACTIVATIONS,
                   help=DECODE_ACTIVATIONS_HELP)
    e.add_argument("--kv-cache-dtype", default=None, choices=KV_CACHE_DTYPES)
    e.add_argument("--kv-host-memory", type=int, default=None, help="host KV tier, bytes")
    e.add_argument("--kv-disk-dir", default=None, help="disk KV tier directory (persists)")
    e.add_argument("--kv-disk-bytes", type=int, default=None, help="disk KV tier capacity")
    e.add_argument("--kv-events-config", type=kv_events_json_arg, default=None,
                   metavar="JSON", help="the engine also publishes KV cache events in vLLM's "
                   "format: vLLM's --kv-events-config JSON (docs/PROTOCOL.md)")  # fmt: skip
    e.add_argument("--engine-args", default="", help="more `engine_proc serve` options")
    e.add_argument(
        "--no-restart",
        action="store_true",
        help="do not restart a spawned engine that dies (default: restart it, with backoff)",
    )
    d = p.add_argument_group("prefill/decode disaggregation (docs/PROTOCOL.md section 10)")
    d.add_argument("--disaggregated", action="store_true",
                   help="spawn a prefill and a decode engine (CPU cores split) and route "
                   "every request through both")  # fmt: skip
    d.add_argument("--connect-prefill", default=None,
                   help="with --disaggregated: a running `--role prefill` engine's endpoint")
    d.add_argument("--connect-decode", default=None,
                   help="with --disaggregated: a running `--role decode` engine's endpoint")
    d.add_argument("--disagg-cores", type=int, default=None,
                   help="cores to split between the two engines (default: all)")
    p.add_argument("--log-level", default="INFO")
    return p


def check_security(args: argparse.Namespace, keys: list[str]) -> str | None:
    """Why these options must not start (None: fine)."""
    if not 0 <= args.port <= 65535:
        return f"--port must be in [0, 65535], got {args.port}"
    if not is_loopback_host(args.host):
        if not keys:
            return (
                f"--host {args.host} is not a loopback address: give --api-key (or "
                f"$KVSCOPE_API_KEY) of at least {MIN_REMOTE_KEY_LENGTH} characters"
            )
        short = [k for k in keys if len(k) < MIN_REMOTE_KEY_LENGTH]
        if short:
            n = MIN_REMOTE_KEY_LENGTH
            return f"API keys must have at least {n} characters on --host {args.host}"
    for name in ("max_pending", "max_body_bytes", "max_n"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}"
    if args.max_tokens is not None and args.max_tokens < 1:
        return f"--max-tokens must be >= 1, got {args.max_tokens}"
    if args.disaggregated and args.connect:
        return "--disaggregated takes --connect-prefill and --connect-decode, not --connect"
    if not args.disaggregated and (args.connect_prefill or args.connect_decode):
        return "--connect-prefill / --connect-decode need --disaggregated"
    if args.disaggregated and args.kv_events_config is not None:
        return "--kv-events-config is for one engine; not with --disaggregated (both would bind it)"
    if args.disagg_cores is not None and args.disagg_cores < 2:
        return f"--disagg-cores must be >= 2, got {args.disagg_cores}"
    return None


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind before anything else starts, so a taken port is a clear error and no engine."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=str(args.log_level).upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    keys = list(args.api_key or []) or (
        [os.environ["KVSCOPE_API_KEY"]] if os.environ.get("KVSCOPE_API_KEY") else []
    )
    why = check_security(args, keys)
    if why is not None:
        print(f"error: {why}", file=sys.stderr)
        return EXIT_BAD_OPTIONS
    if args.model is not None:
        from app.models.catalog import resolve_model

        try:
            args.model = resolve_model(args.model)
        except ValueError as exc:
            print(f"error: --model: {exc}", file=sys.stderr)
            return EXIT_BAD_OPTIONS
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    settings = ServerSettings(
        host=args.host,
        port=sock.getsockname()[1],
        api_keys=keys,
        served_model_names=list(args.served_model_name or []),
        max_body_bytes=args.max_body_bytes,
        max_pending=args.max_pending,
        max_n=args.max_n,
        max_tokens=args.max_tokens,
        cors_origins=list(args.cors_origin),
        allowed_hosts=list(args.allowed_host),
        tool_call_parser=args.tool_call_parser,
    )
    token = args.token or os.environ.get("KVSCOPE_TOKEN") or None
    try:
        asyncio.run(_serve(settings, args, token, sock))
    except KeyboardInterrupt:
        pass
    except EngineStartError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


async def _serve(
    settings: ServerSettings, args: argparse.Namespace, token: str | None, sock: socket.socket
) -> None:
    import uvicorn

    link: Any = EngineLink()
    if args.disaggregated:

        link = DisaggLink()
    app = create_app(settings, link)
    config = uvicorn.Config(
        app, log_level=str(args.log_level).lower(), access_log=False, timeout_keep_alive=30,
        timeout_graceful_shutdown=3, lifespan="off",
    )  # fmt: skip
    server = uvicorn.Server(config)
    fatal: list[str] = []

    def stop_serving(why: str) -> None:
        fatal.append(why)
        server.should_exit = True

    if args.disaggregated:

        keeper: Any = DisaggKeeper(link, args, token, on_fatal=stop_serving)
    else:
        keeper = EngineKeeper(link, args, token, on_fatal=stop_serving)
    keeper.start()
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    # One line on stdout, like the engine's READY line: tools (and the GUI) read the URL here.
    print(f"KVSCOPE_HTTP_READY http://{host}:{settings.port}", flush=True)
    log.info("OpenAI-compatible API on http://%s:%d/v1", host, settings.port)
    try:
        await server.serve(sockets=[sock])
    finally:
        with contextlib.suppress(Exception):
            await keeper.stop()
    if fatal:
        raise EngineStartError(fatal[0])


class EngineStartError(RuntimeError):
    """The spawned engine exited before it was ready."""


if __name__ == "__main__":
    sys.exit(main())
