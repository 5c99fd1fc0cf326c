"""Colocated vs disaggregated serving on the same cores: one benchmark run, one JSON line.

    python -m app.bench.disagg --system kvscope-colocated --workload wl.json --threads 2
    python -m app.bench.disagg --system kvscope-disagg --workload wl.json --threads 2

kvscope-colocated spawns one `engine_proc serve` with every thread (chunked prefill as
configured by the workload); kvscope-disagg spawns a `--role prefill` and a `--role decode`
engine with the threads split between them (app/router/deployment.split_threads) and drives
them through the router (app/router/router.py). Both are driven by the same ZeroMQ client code
as app/bench/clients.py (same timing, same bookkeeping); the disaggregated run also reports what
the KV transfer cost: pulls, seconds per pull, bytes and blocks per request. This module never
imports torch or engine_proc.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import sys
import time
from typing import Any

from app.bench.clients import (
    WARMUP_TOKENS,
    Stream,
    engine_options,
    proc_cpu_s,
    request_results,
    run_and_report,
    start_process,
    summarize,
    zmq_sender,
)
from app.bench.clients import (
    build_parser as clients_parser,
)
from app.router.router import DisaggRouter, mismatch, split_threads
from app.supervisor import EngineSupervisor, engine_command

log = logging.getLogger(__name__)

DISAGG_SYSTEMS = ("kvscope-colocated", "kvscope-disagg")
TRANSFER_COUNTERS = ("kv_transfer_pulls", "kv_transfer_pull_failures", "kv_transfer_pull_seconds",
                     "kv_transfer_bytes_received", "kv_transfer_blocks_received",
                     "kv_transfer_blocks_already_cached", "kv_transfer_releases")


def parse(workload: dict) -> tuple[list[Stream], dict[str, tuple[str, int]]]:
    """The workload's requests, and for those that wait on another one (`after`) what they wait
    for: (request id, tokens it must have streamed; -1 = finished)."""
    reqs = workload.get("requests")
    if not isinstance(reqs, list) or not reqs:
        raise ValueError("workload.requests must be a non-empty list")
    streams: list[Stream] = []
    after: dict[str, tuple[str, int]] = {}
    for i, r in enumerate(reqs):
        rid = str(r["id"])
        if isinstance(r.get("after"), dict):
            ref = str(r["after"].get("request"))
            if ref not in {s.id for s in streams}:
                raise ValueError(f"workload.requests[{i}].after.request must name an earlier one")
            after[rid] = (ref, int(r["after"].get("tokens", -1)))
        elif not isinstance(r.get("arrival_s"), int | float):
            raise ValueError(f"workload.requests[{i}] needs arrival_s or after")
        streams.append(Stream(rid, list(r["prompt"]), int(r["max_tokens"]),
                              float(r.get("arrival_s") or 0.0)))  # fmt: skip
    return streams, after


async def drive(streams: list[Stream], after: dict[str, tuple[str, int]], send: Any) -> float:
    """Send each stream at its arrival time, or once the stream it waits on has streamed its
    tokens (or finished); returns the start time t0."""
    t0 = time.monotonic()
    by_id = {s.id: s for s in streams}

    async def one(s: Stream) -> None:
        if s.id in after:
            ref_id, n = after[s.id]
            ref = by_id[ref_id]
            while not (ref.finish_reason is not None if n < 0 else sum(ref.counts) >= n):
                await asyncio.sleep(0.002)
        else:
            await asyncio.sleep(max(0.0, t0 + s.arrival_s - time.monotonic()))
        s.issued = time.monotonic() if s.id in after else t0 + s.arrival_s
        await send(s)

    await asyncio.gather(*(one(s) for s in streams))
    return t0


def _options(workload: dict, args: argparse.Namespace, role: str, threads: int) -> Any:
    options = engine_options(workload, args)
    extra = list(options.extra_args) + (["--role", role] if role else [])
    return dataclasses.replace(options, num_threads=threads, extra_args=extra)


async def _connect(endpoints: list[str]) -> list[Any]:
    from ipc.async_client import AsyncEngineClient

    clients = [AsyncEngineClient(e, client_name="bench") for e in endpoints]
    for c in clients:
        await c.connect()
    return clients


def _transfer(before: dict[str, float], after: dict[str, float], n: int) -> dict[str, Any]:
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in TRANSFER_COUNTERS}
    pulls = d["kv_transfer_pulls"]
    return {
        "pulls": int(pulls),
        "pull_failures": int(d["kv_transfer_pull_failures"]),
        "releases": int(d["kv_transfer_releases"]),
        "mean_pull_s": d["kv_transfer_pull_seconds"] / pulls if pulls else None,
        "bytes_per_request": d["kv_transfer_bytes_received"] / n if n else None,
        "blocks_per_request": d["kv_transfer_blocks_received"] / n if n else None,
        "blocks_already_cached": int(d["kv_transfer_blocks_already_cached"]),
    }


def _ended(counters: dict[str, float]) -> float:
    return counters.get("kv_transfer_pulls", 0.0) + counters.get("kv_transfer_releases", 0.0)


async def _settled(client: Any, pulls: float, timeout: float = 10.0) -> dict[str, float]:
    """The decode engine's counters once a snapshot shows every handoff of the run ended."""
    deadline = time.monotonic() + timeout
    counters: dict[str, float] = {}
    while time.monotonic() < deadline:
        tel = client.telemetry
        counters = dict(tel.counters) if tel is not None else {}
        if _ended(counters) >= pulls:
            break
        await asyncio.sleep(0.1)
    return counters


async def measure(system: str, workload: dict, streams: list[Stream],
                  after: dict[str, tuple[str, int]], endpoints: list[str],
                  pids: dict[str, int | None], deadline: float) -> dict:
    clients = await _connect(endpoints)
    router = None
    if system == "kvscope-disagg":
        prefill, decode = clients
        why = mismatch(prefill.model_info, decode.model_info)
        if why is not None:
            raise RuntimeError(why)
        router = DisaggRouter(lambda: prefill, lambda: decode, ("prefill", "decode"))
    send = zmq_sender(router if router is not None else clients[0])
    try:
        warm = list(workload.get("meta", {}).get("warmup_prompt") or streams[0].prompt[:8])
        await asyncio.gather(*(send(Stream(f"warmup-{i}", warm, WARMUP_TOKENS, 0.0))
                               for i in range(len(streams))))  # fmt: skip
        before: dict[str, float] = {}
        handoffs0 = 0
        if router is not None:  # the warm-up's pulls counted before the measurement starts
            handoffs0 = router.handoffs
            before = await _settled(clients[-1], handoffs0)
        cpu0 = {k: proc_cpu_s(p) for k, p in pids.items()}
        t0 = await asyncio.wait_for(drive(streams, after, send),
                                    max(1.0, deadline - time.monotonic()))
        cpu1 = {k: proc_cpu_s(p) for k, p in pids.items()}
        after = {}
        if router is not None:  # every handoff of the run ends in a pull or a release
            after = await _settled(clients[-1], _ended(before) + router.handoffs - handoffs0)
    finally:
        for c in clients:
            await c.close()
    result = summarize(streams, t0)
    result.update({
        "cpu_s": {k: cpu1[k] - v for k, v in cpu0.items() if v is not None and cpu1[k] is not None},
        "prefix_hit_rate": None,
        "engine_config": {"block_size": 16},
        "requests": request_results(streams, t0),
    })  # fmt: skip
    if router is not None:
        result["transfer"] = _transfer(before, after, len(streams)) | {
            "handoffs": router.handoffs - handoffs0}
    return result


def run(args: argparse.Namespace) -> dict:
    with open(args.workload) as f:
        workload = json.load(f)
    streams, after = parse(workload)
    threads = args.threads or len(os.sched_getaffinity(0))
    deadline = time.monotonic() + args.timeout
    if args.system == "kvscope-colocated":
        plan = [("", threads)]
    else:
        plan = list(zip(("prefill", "decode"), split_threads(threads), strict=True))
    procs: list[EngineSupervisor] = []
    endpoints: list[str] = []
    pids: dict[str, int | None] = {}
    try:
        t_load = time.monotonic()
        for role, n in plan:
            sup, endpoint = start_process(engine_command(_options(workload, args, role, n)),
                                          f"{role or 'colocated'} engine", deadline)
            procs.append(sup)
            endpoints.append(endpoint)
            pids[role or "engine"] = sup.pid
        load_s = time.monotonic() - t_load
        result = asyncio.run(measure(args.system, workload, streams, after, endpoints, pids,
                                     deadline))
    finally:
        for p in procs:
            p.stop()
    return result | {"load_s": load_s, "threads": dict(
        (role or "engine", n) for role, n in plan)}  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    ap = clients_parser()
    ap.prog = "python -m app.bench.disagg"
    for action in ap._actions:
        if action.dest == "system":
            action.choices = DISAGG_SYSTEMS
    return ap


def main(argv: list[str] | None = None) -> int:
    return run_and_report(build_parser().parse_args(argv), run)


if __name__ == "__main__":
    sys.exit(main())
