"""The window's own measurement, headless: a chat reply's decode tok/s alone, then with N
load-generator chats running.

The engine is started the way the window starts it (`python -m engine_proc serve` with the GUI's
thread count and niceness, app/supervisor.py); the reply is a greedy chat of about 60 prompt
tokens and ``--max-tokens`` new ones through the ordinary protocol (ipc.client), timed from its
first token to its last; the load is app/load_generator.py on a connection of its own, as the
window's *Load generator* runs it.

    python -m app.bench.reply --load 16 [--repeats 2] [--settle 8]
"""

from __future__ import annotations

import argparse
import logging
import shlex
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from app.load_generator import LoadConfig, LoadStats
from app.load_generator import run as run_load
from app.supervisor import (
    APP_DECODE_ACTIVATIONS,
    EngineOptions,
    EngineSupervisor,
    engine_command,
    gui_engine_threads,
)

if TYPE_CHECKING:
    from ipc.client import EngineClient

log = logging.getLogger(__name__)

REPLY_MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant. Answer in plain prose."},
    {"role": "user", "content": (
        "Explain how a paged key-value cache lets a language model serve many chats at once, "
        "and why prefix caching makes a shared system prompt cheap."
    )},
]


@dataclass(slots=True)
class Reply:
    tokens: int
    ttft_s: float
    decode_tok_s: float  # tokens after the first, over the time from the first to the last


def time_reply(client: EngineClient, max_tokens: int) -> Reply:
    """One greedy chat reply of exactly ``max_tokens`` tokens, timed as the window times it:
    the tokens after the first delta over the time from the first delta to the last."""
    start = time.perf_counter()
    stream = client.chat(REPLY_MESSAGES, temperature=0.0, max_tokens=max_tokens,
                         ignore_eos=True)
    first = last = 0.0
    tokens = first_delta = 0
    for event in stream:
        ids = getattr(event, "token_ids", None)
        if ids:
            last = time.perf_counter()
            if tokens == 0:
                first, first_delta = last, len(ids)
            tokens += len(ids)
    finish = stream.finish
    if finish is None or finish.reason == "error" or tokens - first_delta < 1:
        raise RuntimeError(f"the reply failed or came in one piece: {finish!r}")
    return Reply(tokens, first - start, (tokens - first_delta) / max(last - first, 1e-9))


def start_engine(options: EngineOptions, timeout: float) -> tuple[EngineSupervisor, str]:
    ready = threading.Event()
    shown: set[int] = set()

    def progress(fraction: float, message: str) -> None:
        if int(10 * fraction) not in shown:  # a line per tenth, not per tensor
            shown.add(int(10 * fraction))
            log.info("engine loading: %3.0f%% %s", 100 * fraction, message)

    sup = EngineSupervisor(engine_command(options), on_ready=lambda _: ready.set(), nice=5,
                           on_progress=progress)
    sup.start()
    if not ready.wait(timeout):
        sup.stop()
        raise RuntimeError("the engine was not ready in time:\n" + "\n".join(sup.tail(20)))
    assert sup.ready_info is not None
    return sup, str(sup.ready_info["endpoint"])


def measure(endpoint: str, token: str | None, load: int, repeats: int, settle: float,
            max_tokens: int) -> tuple[list[Reply], list[Reply], LoadStats | None, float]:
    """Replies alone, replies under load, the load's counts and how long it ran (s)."""
    from ipc.client import EngineClient

    with EngineClient(endpoint, token=token, client_name="gui") as client:
        time_reply(client, 8)  # warm-up: the first step of each shape pays one-off costs
        alone = [time_reply(client, max_tokens) for _ in range(repeats)]
        log.info("alone: %s", ", ".join(f"{r.decode_tok_s:.1f}" for r in alone))
        if load <= 0:
            return alone, [], None, 0.0
        config = LoadConfig(concurrency=load)
        result: list[LoadStats] = []
        stop = threading.Event()
        loader = threading.Thread(
            target=lambda: result.append(run_load(endpoint, config, 1e9, token, stop)),
            name="load", daemon=True,
        )
        loader.start()
        loaded = []
        try:
            time.sleep(settle)
            for _ in range(repeats):
                loaded.append(time_reply(client, max_tokens))
                log.info("with %d chats: %.1f tok/s", load, loaded[-1].decode_tok_s)
        finally:  # the load stops with the measurement, failed or not
            stop.set()
            loader.join()
        stats = result[0] if result else None
        return alone, loaded, stats, time.monotonic() - stats.started if stats else 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m app.bench.reply", description=__doc__.split(
        "\n\n")[0])
    ap.add_argument("--load", type=int, default=16, help="load-generator chats (0 = none)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--settle", type=float, default=8.0,
                    help="seconds of load before the reply is sent")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--connect", default=None,
                    help="measure a running engine (tcp://...) instead of starting one")
    ap.add_argument("--token", default=None)
    ap.add_argument("--engine-args", default="", help='extra engine flags, e.g. "--num-threads 2"')
    ap.add_argument("--timeout", type=float, default=600.0, help="engine start-up limit (s)")
    a = ap.parse_args(argv)
    for flag, value, least in (("--load", a.load, 0), ("--repeats", a.repeats, 1),
                               ("--max-tokens", a.max_tokens, 2),  # tok/s needs two tokens
                               ("--settle", a.settle, 0)):
        if value < least:
            ap.error(f"{flag} must be >= {least}, got {value}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    sup = None
    endpoint = a.connect
    if endpoint is None:
        options = EngineOptions(num_threads=gui_engine_threads(), decode_weights="auto",
                                decode_activations=APP_DECODE_ACTIVATIONS,
                                extra_args=shlex.split(a.engine_args))
        log.info("starting the engine as the window does: %s",
                 " ".join(engine_command(options)))
        sup, endpoint = start_engine(options, a.timeout)
    try:
        alone, loaded, stats, load_seconds = measure(endpoint, a.token, a.load, a.repeats, a.settle,
                                       a.max_tokens)
    finally:
        if sup is not None:
            sup.stop()
    med = statistics.median
    print(f"reply alone: {med(r.decode_tok_s for r in alone):.1f} tok/s "
          f"({', '.join(f'{r.decode_tok_s:.1f}' for r in alone)})")
    if loaded:
        print(f"reply with {a.load} load-generator chats: "
              f"{med(r.decode_tok_s for r in loaded):.1f} tok/s "
              f"({', '.join(f'{r.decode_tok_s:.1f}' for r in loaded)}), "
              f"TTFT {med(r.ttft_s for r in loaded) * 1000:.0f} ms")
    if stats is not None:
        print(f"load: {stats.generated_tokens / max(load_seconds, 1e-9):.1f} tok/s generated, "
              f"{stats.finished} chats finished, {stats.errors} errors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
