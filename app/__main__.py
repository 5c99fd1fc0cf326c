"""`python -m app` / `kvscope`: the desktop app, and its subcommands.

    kvscope [gui] [options]      the window (spawns the engine, or --connect to a running one,
                                 or --connect http://HOST:PORT to watch vLLM, SGLang, llama.cpp's
                                 server or `kvscope serve` over HTTP; with --kv-events
                                 tcp://HOST:5557 its prefix tree from its KV events)
    kvscope chat ...             terminal chat (app.chat)
    kvscope bench ...            benchmarks (app.bench)
    kvscope serve ...            OpenAI-compatible HTTP API and Prometheus metrics (app.serve)
    kvscope models ...           the models on this machine and what they need (app.models.catalog)

GUI extras: `--screenshot OUT.png [--load N]` renders the window under load to a PNG and exits;
`--measure-latency SECONDS [--load 32] [--measure-reply 128]` prints the GUI event-loop latency
percentiles (and a chat reply's tok/s alone and under the load);
`--demo` drives every panel from a synthetic engine (no model, no torch).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from app.supervisor import (
    APP_DECODE_ACTIVATIONS,
    DECODE_ACTIVATIONS,
    DECODE_ACTIVATIONS_HELP,
    DECODE_WEIGHTS,
    DTYPES,
    KV_CACHE_DTYPES,
    KV_DISK_SUBDIR,
)
from ipc.vllm_events.config import kv_events_json_arg

SUBCOMMANDS = {"chat": "app.chat", "bench": "app.bench.suite", "serve": "app.serve",
               "models": "app.models.catalog"}  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvscope",
        description="KVScope desktop app. Subcommands: gui (default), chat, bench, serve, models.",
    )
    ap.add_argument(
        "--connect",
        metavar="ENDPOINT",
        help="attach to a running engine instead of spawning one (e.g. tcp://127.0.0.1:5557), "
        "or watch a server over HTTP: http://HOST:PORT of vLLM, SGLang, llama.cpp's server "
        "(--metrics) or kvscope serve",
    )
    ap.add_argument(
        "--kv-events",
        metavar="ENDPOINT",
        help="with --connect http://...: the server's KV event publisher (vLLM's or SGLang's "
        "--kv-events-config endpoint, e.g. tcp://HOST:5557, or ipc://PATH); the Prefix tree tab "
        "draws its blocks",
    )
    ap.add_argument(
        "--kv-events-replay",
        metavar="ENDPOINT",
        help="that publisher's replay_endpoint (e.g. tcp://HOST:5558): events missed while "
        "joining or lost on the way are asked for again",
    )
    ap.add_argument(
        "--fleet",
        metavar="URL=EVENTS[+REPLAY],...",
        help="watch several servers at once in the fleet panel instead of one engine: per "
        "replica its http://HOST:PORT and optionally its KV event publisher (and replay "
        "endpoint), e.g. http://A:8000=tcp://A:5557+tcp://A:5558,http://B:8000=tcp://B:5557",
    )
    ap.add_argument(
        "--kv-events-topic", default="", help="subscribe to this topic prefix only (default: all)"
    )
    ap.add_argument("--token", default=None, help="engine access token (or $KVSCOPE_TOKEN)")
    ap.add_argument(
        "--api-key",
        default=None,
        help="API key of the server given by --connect http://... (or $KVSCOPE_API_KEY)",
    )
    ap.add_argument(
        "--data-dir",
        default=None,
        help="conversations and settings directory "
        "(default: the platform's app data dir; or $KVSCOPE_DATA_DIR)",
    )
    g = ap.add_argument_group("spawned engine")
    g.add_argument("--model", default=None,
                   help="GGUF file, HF directory or a name `kvscope models` lists")  # fmt: skip
    g.add_argument("--draft-model", default=None, metavar="PATH",
                   help="a smaller model with the same tokenizer that proposes the drafts of "
                   "speculative decoding (Engine → Speculative decoding; remembered)")  # fmt: skip
    g.add_argument("--dtype", default=None, choices=DTYPES)
    g.add_argument("--device", default=None, help="auto | cpu | cuda | cuda:N")
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument(
        "--decode-weights",
        default=None,
        choices=DECODE_WEIGHTS,
        help="int4: 4-bit weight copies for decode on CPU, ~2x faster replies; dense: the "
        "model's own precision; auto (the default): int4 on a CPU, dense on a GPU (remembered)",
    )
    g.add_argument("--decode-activations", default=None, choices=DECODE_ACTIVATIONS,
                   help=f"{DECODE_ACTIVATIONS_HELP} (remembered)")
    g.add_argument("--kv-events-config", type=kv_events_json_arg, default=None, metavar="JSON",
                   help="the engine also publishes KV cache events in vLLM's format: vLLM's "
                   "--kv-events-config JSON (docs/PROTOCOL.md)")  # fmt: skip
    g.add_argument(
        "--engine-args",
        default="",
        help="more `python -m engine_proc serve` options, as one shell-quoted string",
    )
    t = ap.add_argument_group("tools")
    t.add_argument(
        "--demo", action="store_true", help="synthetic engine: try the UI without a model"
    )
    t.add_argument("--screenshot", metavar="OUT.png", help="render the window to a PNG and exit")
    t.add_argument(
        "--load",
        type=int,
        default=0,
        metavar="N",
        help="start N concurrent synthetic chats once the engine is ready",
    )
    t.add_argument(
        "--load-max-tokens",
        type=int,
        default=96,
        metavar="N",
        help="longest synthetic reply of --load (shortest: N/6)",
    )
    t.add_argument(
        "--settle",
        type=float,
        default=8.0,
        metavar="S",
        help="seconds of load before --screenshot captures (default 8)",
    )
    t.add_argument(
        "--measure-latency",
        type=float,
        default=None,
        metavar="S",
        help="measure GUI event-loop latency for S seconds (use with --load 32), "
        "print percentiles, exit",
    )
    g.add_argument(
        "--measure-reply",
        type=int,
        default=0,
        metavar="TOKENS",
        help="with --measure-latency: also time a greedy chat reply of up to TOKENS tokens "
        "alone, then another under the --load, with the event loop's latency during each",
    )
    t.add_argument(
        "--refresh-hz", type=float, default=10.0, help="chart and block map redraw rate (10-30)"
    )
    t.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="give up a --screenshot / --measure-latency run after S seconds",
    )
    t.add_argument("--log-level", default="WARNING")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        try:
            mod = importlib.import_module(SUBCOMMANDS[argv[0]])
        except ImportError as exc:
            print(f"kvscope {argv[0]}: unavailable ({exc})", file=sys.stderr)
            return 2
        return int(mod.main(argv[1:]) or 0)
    if argv and argv[0] == "gui":
        argv = argv[1:]
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return run_gui(args)


def kv_events_arg(args: argparse.Namespace):
    """The --kv-events source (None without one); ValueError naming the flag that is wrong."""
    from app.remote.kv_events_source import make_source
    from app.remote.probe import is_http_url

    source = make_source(args.kv_events, args.kv_events_replay, args.kv_events_topic,
                         fields=("--kv-events", "--kv-events-replay"))  # fmt: skip
    if source is not None and not is_http_url(args.connect):
        raise ValueError("--kv-events needs --connect http://HOST:PORT (the server whose KV "
                         "events they are)")
    return source


def fleet_arg(args: argparse.Namespace):
    """The --fleet replicas (None without it); ValueError naming the flag that is wrong."""
    from app.remote.fleet import parse_fleet

    if args.fleet is None:
        return None
    for flag in ("connect", "kv_events", "kv_events_replay"):
        if getattr(args, flag):
            name = "--" + flag.replace("_", "-")
            raise ValueError(f"--fleet names every server and its events; not with {name}")
    return parse_fleet(args.fleet)


def run_gui(args: argparse.Namespace) -> int:
    try:
        kv_events = kv_events_arg(args)
        fleet = fleet_arg(args)
    except ValueError as exc:
        print(f"kvscope: {exc}", file=sys.stderr)
        return 2
    headless = bool(args.screenshot or args.measure_latency)
    if headless and not os.environ.get("DISPLAY") and not os.environ.get("WAYLAND_DISPLAY"):
        os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from ui.platform_check import platform_problem

    problem = platform_problem()  # Qt itself would abort the process, naming no package
    if problem:
        print(f"kvscope: {problem}", file=sys.stderr)
        return 1
    from PySide6.QtWidgets import QApplication

    from app.conversations import ConversationStore
    from app.settings import APP, ORG, data_dir, open_settings
    from ui import theme
    from ui.qt_compat import collect_garbage_on_gui_thread
    from ui.window.main_window import EngineSource, MainWindow

    app = QApplication.instance() or QApplication([sys.argv[0]])
    collect_garbage_on_gui_thread()
    app.setOrganizationName(ORG)
    app.setApplicationName(APP)
    theme.apply_dark_theme(app)
    if fleet is not None:
        return _run_fleet(app, fleet, args.api_key or os.environ.get("KVSCOPE_API_KEY"))
    ddir = data_dir(args.data_dir)
    settings = open_settings(args.data_dir)
    store = ConversationStore(ddir / "conversations")
    try:
        args.model = _resolve_model_arg(args.model, settings)
    except ValueError as exc:
        print(f"kvscope: --model: {exc}", file=sys.stderr)
        return 2
    options = _engine_options(args, settings, ddir)
    from app.remote.probe import is_http_url, normalize_url

    connect = "demo://" if args.demo else args.connect
    api_key = None
    if is_http_url(connect):
        try:
            connect = normalize_url(connect)
        except ValueError as exc:
            print(f"kvscope: --connect: {exc}", file=sys.stderr)
            return 2
        api_key = args.api_key or os.environ.get("KVSCOPE_API_KEY")
    source = EngineSource(
        connect=connect,
        options=options,
        token=args.token or os.environ.get("KVSCOPE_TOKEN"),
        api_key=api_key,
        kv_events=kv_events,
    )
    win = MainWindow(settings, store, source, refresh_hz=args.refresh_hz, data_dir=ddir)
    win.show()
    win.start_engine()
    app.aboutToQuit.connect(win.shutdown)
    from app import headless

    if args.screenshot:
        return headless.screenshot(app, win, Path(args.screenshot), args)
    if args.measure_latency is not None:
        return headless.measure(app, win, args)
    if args.load:
        headless.when_ready(win, lambda: headless.start_load(win, args.load,
                                                             args.load_max_tokens))
    return app.exec()


def _run_fleet(app, replicas, api_key: str | None) -> int:
    """The fleet panel alone: no engine of our own to spawn."""
    from ui.fleet.panel import FleetPanel

    panel = FleetPanel(replicas, api_key=api_key)
    panel.resize(1200, 800)
    panel.show()
    panel.start()
    app.aboutToQuit.connect(panel.stop)
    return app.exec()


def _resolve_model_arg(model: str | None, settings) -> str | None:
    """A `--model` name (not a path) as the path the catalog lists it under, searching the
    folders added in *File → Models…* too."""
    from app.models.catalog import FOLDERS_KEY, resolve_model

    folders = settings.value(FOLDERS_KEY) or []
    folders = [folders] if isinstance(folders, str) else [str(f) for f in folders]
    return resolve_model(model, folders)


def _engine_options(args: argparse.Namespace, settings, ddir: Path | None = None) -> Any:
    """Command-line values win; the rest come from the last session (QSettings). The disk KV
    tier lives in `ddir`/kv-cache (no disk tier without a data directory)."""
    from app.supervisor import EngineOptions, gui_engine_threads

    def pick(name: str, kind: type, choices: tuple[str, ...] | None = None):
        v = getattr(args, name)
        if v is not None:
            settings.setValue(f"engine/{name}", v)
            return v
        stored = settings.value(f"engine/{name}")
        try:
            value = kind(stored) if stored not in (None, "") else None
        except (TypeError, ValueError):
            return None
        # A hand-edited or stale settings file must not stop the engine from starting.
        return None if choices and value not in choices else value

    return EngineOptions(
        model=pick("model", str),
        dtype=pick("dtype", str, DTYPES),
        device=pick("device", str),
        num_kv_blocks=pick("num_kv_blocks", int),
        max_model_len=pick("max_model_len", int),
        decode_weights=pick("decode_weights", str, DECODE_WEIGHTS) or "auto",
        decode_activations=pick("decode_activations", str, DECODE_ACTIVATIONS)
        or APP_DECODE_ACTIVATIONS,
        # `--engine-args "--num-threads N"` comes later on the command line and wins.
        num_threads=gui_engine_threads(),
        **_kv_options(settings, ddir),
        kv_events_config=getattr(args, "kv_events_config", None),  # not remembered: per run
        speculative_tokens=_spec_tokens(settings),
        draft_model=pick("draft_model", str),
        extra_args=shlex.split(args.engine_args),
    )


def _spec_tokens(settings) -> int:
    """*Engine → Speculative decoding*'s remembered draft length; anything else is off."""
    from app.supervisor import SPECULATIVE_TOKEN_CHOICES

    try:
        value = int(settings.value("engine/speculative_tokens") or 0)
    except (TypeError, ValueError):
        return 0
    return value if value in SPECULATIVE_TOKEN_CHOICES else 0


# Largest remembered tier sizes taken as they are (a bigger one is a typo, not a wish).
KV_HOST_MAX_BYTES = 1 << 40
KV_DISK_MAX_BYTES = 1 << 44


def _kv_options(settings, ddir: Path | None) -> dict[str, Any]:
    """EngineOptions' KV fields from *Engine → KV cache* (engine/kv_cache_dtype,
    engine/kv_host_memory and engine/kv_disk_bytes). A value that is not one the engine takes is
    dropped."""

    def stored_bytes(key: str, most: int) -> int:
        value = settings.value(f"engine/{key}")
        if isinstance(value, bool):
            return 0
        try:
            n = int(value) if value not in (None, "") else 0
        except (TypeError, ValueError):
            return 0
        return n if 0 < n <= most else 0

    dtype = settings.value("engine/kv_cache_dtype")
    dtype = dtype if isinstance(dtype, str) and dtype in KV_CACHE_DTYPES else None
    host = stored_bytes("kv_host_memory", KV_HOST_MAX_BYTES)
    disk = stored_bytes("kv_disk_bytes", KV_DISK_MAX_BYTES) if ddir is not None else 0
    return {
        "kv_cache_dtype": dtype,
        "kv_host_memory": host or None,
        "kv_disk_bytes": disk or None,
        "kv_disk_dir": str(Path(ddir) / KV_DISK_SUBDIR) if disk and ddir is not None else None,
    }


if __name__ == "__main__":
    raise SystemExit(main())
