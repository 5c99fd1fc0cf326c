"""Measure: does a telemetry subscriber that never reads slow the engine down?

    python -m tests.ipc.measure_slow_subscriber [--default-model] [--max-tokens 64] [--rounds 2]

One engine process; alternating rounds of 32 concurrent greedy requests with no subscriber (A)
and with a SUB socket that is connected but never read (B). Prints generation tokens/s of each
and the ratio B/A (1.0 = no effect). Not a test: timings on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import zmq

from ipc.client import EngineClient
from tests.ipc.helpers import TINY, EngineProc


def one_round(client: EngineClient, n: int, max_tokens: int) -> float:
    start = time.monotonic()
    streams = [
        client.generate(
            f"round prompt {i} " + "x" * (i % 7),
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=True,
        )
        for i in range(n)
    ]
    tokens = sum(s.result(600).finish.usage.completion_tokens for s in streams)
    return tokens / (time.monotonic() - start)


def stalled_subscriber(endpoint: str) -> zmq.Socket:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 1)
    sub.setsockopt(zmq.RCVBUF, 4096)  # small kernel buffer: back-pressure reaches the PUB fast
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    return sub


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--default-model", action="store_true", help="SmolLM2 instead of the tiny model")
    p.add_argument("--num-blocks", type=int, default=16384, help="big pools = big snapshots")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--telemetry-hz", type=float, default=20.0)
    args = p.parse_args(argv)
    engine_args = [] if args.default_model else list(TINY)
    engine_args += [
        "--num-blocks",
        str(args.num_blocks),
        "--telemetry-hz",
        str(args.telemetry_hz),
        "--log-level",
        "WARNING",
    ]
    proc = EngineProc(engine_args)
    try:
        with EngineClient(proc.endpoint) as client:
            one_round(client, args.requests, 4)  # warm-up
            a: list[float] = []
            b: list[float] = []
            for _ in range(args.rounds):
                a.append(one_round(client, args.requests, args.max_tokens))
                sub = stalled_subscriber(proc.pub_endpoint)
                time.sleep(0.5)  # let the subscription reach the PUB and its queue fill up
                b.append(one_round(client, args.requests, args.max_tokens))
                sub.close()
            ra, rb = statistics.mean(a), statistics.mean(b)
            print(
                f"{args.requests} concurrent requests x {args.max_tokens} tokens, "
                f"{args.num_blocks} blocks, telemetry {args.telemetry_hz} Hz"
            )
            print(
                f"no subscriber:           {ra:8.1f} tok/s  (rounds: "
                f"{', '.join(f'{x:.1f}' for x in a)})"
            )
            print(
                f"subscriber never reads:  {rb:8.1f} tok/s  (rounds: "
                f"{', '.join(f'{x:.1f}' for x in b)})"
            )
            print(f"ratio (stalled / none):  {rb / ra:.3f}")
    finally:
        proc.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
