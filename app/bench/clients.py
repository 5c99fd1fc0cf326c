"""One benchmark run of the engine process behind one of its front-ends; one JSON line on stdout.

    python -m app.bench.clients --system kvscope-zmq --workload wl.json [--threads 1]
    python -m app.bench.clients --system kvscope-http --workload wl.json [--threads 1]

Both systems spawn the same `python -m engine_proc serve` (identical options: dense weights, the
run's dtype and torch threads, a KV pool that holds every request at full length). kvscope-zmq
drives it from here with ipc.AsyncEngineClient; kvscope-http also spawns `python -m app serve
--connect ENDPOINT` and drives that with httpx async streaming (POST /v1/completions, SSE). The
driver, the timing and the bookkeeping are the same code for both (`drive`); only the coroutine
that sends one request and reads its stream differs. Every process of a system shares the
machine, so the measured tok/s is what the whole system (engine, server, client) achieves, and
the CPU seconds each process spent in the measured window are reported beside it.

Timing: client-side `time.monotonic()` when a message (ZeroMQ delta, SSE chunk) is read. An SSE
chunk carries one engine delta whose text is non-empty (one token per step here; a token whose
text is an incomplete UTF-8 sequence rides with the next chunk), so HTTP token times are chunk
times and its token count comes from the final usage chunk. Before the measurement each system
serves one warm-up request per stream (same path, so HTTP keep-alive connections are open, as
in a client with a connection pool). This module never imports torch or engine_proc.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import resource
import shlex
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from app.supervisor import DTYPES, EngineOptions, EngineSupervisor, engine_command
from ipc import protocol as P

log = logging.getLogger(__name__)

CLIENT_SYSTEMS = ("kvscope-zmq", "kvscope-http")
HTTP_READY_PREFIX = "KVSCOPE_HTTP_READY "
WARMUP_TOKENS = 4
BLOCK_SIZE = 16  # the engine's default; sizes the KV pool below
# The engine heartbeats between steps and clients give up after 3 silent intervals; one CPU
# step that prefills 32 prompts at once takes several seconds, longer than the default 1 s
# interval allows. Only liveness detection changes (and both systems get the same value).
HEARTBEAT_INTERVAL_S = 20.0
# workload["engine"] keys -> `engine_proc serve` flags
ENGINE_FLAGS = {"max_num_seqs": "--max-num-seqs", "max_num_batched_tokens":
                "--max-num-batched-tokens", "long_prefill_chunk": "--long-prefill-chunk",
                "decode_activations": "--decode-activations"}


@dataclass(slots=True)
class Stream:
    """One request and what its client saw of it."""

    id: str
    prompt: list[int]
    max_tokens: int
    arrival_s: float
    issued: float | None = None  # absolute monotonic time the request was due
    times: list[float] = field(default_factory=list)  # arrival of each message with tokens
    counts: list[int] = field(default_factory=list)  # tokens each message carried
    text: list[str] = field(default_factory=list)
    token_ids: list[int] | None = None  # the ZeroMQ path sees ids; HTTP only text
    usage_tokens: int | None = None  # completion tokens as the server counted them
    cached_tokens: int = 0
    finish_reason: str | None = None

    @property
    def output_tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else sum(self.counts)


def parse_streams(workload: dict) -> list[Stream]:
    reqs = workload.get("requests")
    if not isinstance(reqs, list) or not reqs:
        raise ValueError("workload.requests must be a non-empty list")
    out = []
    for i, r in enumerate(reqs):
        if not isinstance(r.get("arrival_s"), int | float):
            raise ValueError(f"workload.requests[{i}].arrival_s must be a number (this runner "
                             "serves timed arrivals only, not 'after')")
        out.append(Stream(str(r["id"]), list(r["prompt"]), int(r["max_tokens"]),
                          float(r["arrival_s"])))
    if len({s.id for s in out}) != len(out):
        raise ValueError("workload.requests ids must be unique")
    return out


# --------------------------------------------------------------------------------------------
# One request through each front-end (the only code that differs between the systems)

Send = Callable[[Stream], Awaitable[None]]


def zmq_sender(client: Any) -> Send:
    async def send(s: Stream) -> None:
        sampling = P.SamplingOptions(max_tokens=s.max_tokens, temperature=0.0, ignore_eos=True)
        stream = await client.generate(s.id, prompt=s.prompt, sampling=sampling)
        s.token_ids = []
        async for msg in stream:
            now = time.monotonic()
            if isinstance(msg, P.Delta):
                if msg.token_ids:
                    s.times.append(now)
                    s.counts.append(len(msg.token_ids))
                    s.token_ids.extend(msg.token_ids)
                s.text.append(msg.text)
            else:
                s.finish_reason = msg.reason
                s.usage_tokens = msg.usage.completion_tokens
                s.cached_tokens = msg.usage.cached_tokens

    return send


def http_sender(client: Any) -> Send:
    decode = msgspec.json.Decoder().decode

    async def send(s: Stream) -> None:
        body = {"prompt": s.prompt, "max_tokens": s.max_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:500]!r}")
            async for line in resp.aiter_lines():
                now = time.monotonic()
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = decode(data)
                if "error" in chunk:
                    raise RuntimeError(f"error in the stream of {s.id}: {chunk['error']}")
                for choice in chunk["choices"]:
                    if choice["text"]:
                        s.times.append(now)
                        s.counts.append(1)
                        s.text.append(choice["text"])
                    if choice["finish_reason"]:
                        s.finish_reason = choice["finish_reason"]
                usage = chunk.get("usage")
                if usage:
                    s.usage_tokens = usage["completion_tokens"]
                    details = usage.get("prompt_tokens_details") or {}
                    s.cached_tokens = details.get("cached_tokens") or 0

    return send


async def drive(streams: list[Stream], send: Send) -> float:
    """Send every stream at its arrival time, concurrently; returns the start time t0."""
    t0 = time.monotonic()

    async def one(s: Stream) -> None:
        await asyncio.sleep(max(0.0, t0 + s.arrival_s - time.monotonic()))
        s.issued = t0 + s.arrival_s  # it was due then, however late the loop got to it
        await send(s)

    await asyncio.gather(*(one(s) for s in streams))
    return t0


# --------------------------------------------------------------------------------------------
# Results (the same per-request fields as engine_proc.bench.worker)


def request_results(streams: list[Stream], t0: float) -> list[dict]:
    rows = []
    for s in streams:
        t = [x for x, n in zip(s.times, s.counts, strict=True) for _ in range(n)]
        n_out = s.output_tokens
        rows.append({
            "id": s.id,
            "prompt_tokens": len(s.prompt),
            "output_tokens": n_out,
            "messages": len(s.times),
            "cached_tokens": s.cached_tokens,
            "finish_reason": s.finish_reason,
            "arrival": None if s.issued is None else s.issued - t0,
            "ttft": t[0] - s.issued if t and s.issued is not None else None,
            "tpot": (t[-1] - t[0]) / (n_out - 1) if t and n_out > 1 else None,
            "e2e": t[-1] - s.issued if t and s.issued is not None else None,
            "itl": [round(b - a, 6) for a, b in zip(t, t[1:], strict=False)],
            "token_times": [round(x - t0, 6) for x in t],
            "text": "".join(s.text),
            "token_ids": s.token_ids,
        })  # fmt: skip
    return rows


def summarize(streams: list[Stream], t0: float) -> dict:
    ends = [s.times[-1] for s in streams if s.times]
    wall = (max(ends) - t0) if ends else 0.0
    out_tokens = sum(s.output_tokens for s in streams)
    prompt_tokens = sum(len(s.prompt) for s in streams)
    return {
        "wall_s": wall,
        "num_requests": len(streams),
        "output_tokens": out_tokens,
        "prompt_tokens": prompt_tokens,
        "output_tok_s": out_tokens / wall if wall > 0 else None,
        "total_tok_s": (out_tokens + prompt_tokens) / wall if wall > 0 else None,
    }


def proc_cpu_s(pid: int | None) -> float | None:
    """User + system CPU seconds of a live process, all its threads (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_peak_rss_mb(pid: int | None) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


# --------------------------------------------------------------------------------------------
# The processes of a system


def start_process(command: list[str], name: str, deadline: float,
                  http: bool = False) -> tuple[EngineSupervisor, str]:
    """Start `command` and wait for its ready line: the engine's KVSCOPE_READY (-> its ROUTER
    endpoint) or, with `http`, the server's KVSCOPE_HTTP_READY (-> its base URL)."""
    ready = threading.Event()
    found: list[str] = []

    def on_log(line: str) -> None:
        if http and line.startswith(HTTP_READY_PREFIX) and not found:
            found.append(line[len(HTTP_READY_PREFIX):].strip())
            ready.set()

    def on_ready(info: dict) -> None:
        if not http:
            found.append(str(info["endpoint"]))
            ready.set()

    sup = EngineSupervisor(command, on_ready=on_ready, on_log=on_log,
                           on_exit=lambda code: ready.set())
    sup.start()
    if not ready.wait(max(0.0, deadline - time.monotonic())) or not found:
        tail = " | ".join(sup.tail(8))
        sup.stop()
        raise RuntimeError(f"the {name} did not get ready: {tail}")
    return sup, found[0]


async def wait_healthy(client: Any, deadline: float) -> None:
    """/health answers 200 once the server is attached to the engine."""
    while time.monotonic() < deadline:
        try:
            if (await client.get("/health")).status_code == 200:
                return
        except Exception:  # noqa: BLE001 - not listening yet
            pass
        await asyncio.sleep(0.1)
    raise RuntimeError("the HTTP server did not get healthy in time")


def engine_options(workload: dict, args: argparse.Namespace) -> EngineOptions:
    reqs = workload["requests"]
    need = sum(-(-(len(r["prompt"]) + r["max_tokens"]) // BLOCK_SIZE) for r in reqs)
    extra = shlex.split(args.engine_args) + [
        "--heartbeat-interval", str(HEARTBEAT_INTERVAL_S), "--log-level", "WARNING"]
    for key, value in (workload.get("engine") or {}).items():
        if key not in ENGINE_FLAGS:
            raise ValueError(f"workload.engine.{key}: allowed keys are {sorted(ENGINE_FLAGS)}")
        extra += [ENGINE_FLAGS[key], str(value)]
    return EngineOptions(model=args.model, dtype=args.dtype, device=args.device,
                         num_kv_blocks=args.kv_blocks or need + 64,
                         decode_weights=args.decode_weights,
                         num_threads=args.threads, extra_args=extra)


async def measure(system: str, workload: dict, streams: list[Stream], endpoint: str,
                  url: str | None, pids: dict[str, int | None], deadline: float) -> dict:
    if system == "kvscope-zmq":
        from ipc.async_client import AsyncEngineClient

        zmq_client = AsyncEngineClient(endpoint, client_name="bench")
        await zmq_client.connect()
        send, close = zmq_sender(zmq_client), zmq_client.close
    else:
        import httpx

        n = len(streams) + 4
        http_client = httpx.AsyncClient(
            base_url=str(url), timeout=httpx.Timeout(max(1.0, deadline - time.monotonic())),
            limits=httpx.Limits(max_connections=n, max_keepalive_connections=n))
        send, close = http_sender(http_client), http_client.aclose
    try:
        if system == "kvscope-http":
            await wait_healthy(http_client, deadline)
        warm = list(workload.get("meta", {}).get("warmup_prompt") or streams[0].prompt[:8])
        await asyncio.gather(*(send(Stream(f"warmup-{i}", warm, WARMUP_TOKENS, 0.0))
                               for i in range(len(streams))))
        cpu0 = {k: proc_cpu_s(p) for k, p in pids.items()} | {"client": time.process_time()}
        t0 = await asyncio.wait_for(drive(streams, send), max(1.0, deadline - time.monotonic()))
        cpu1 = {k: proc_cpu_s(p) for k, p in pids.items()} | {"client": time.process_time()}
    finally:
        await close()
    result = summarize(streams, t0)
    rss = {k: proc_peak_rss_mb(p) for k, p in pids.items()}
    rss["client"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    result.update({
        "cpu_s": {k: cpu1[k] - v for k, v in cpu0.items() if v is not None and cpu1[k] is not None},
        "rss_mb": rss,
        "peak_rss_mb": sum(v for v in rss.values() if v is not None),
        "prefix_hit_rate": None,
        "engine_config": {"block_size": BLOCK_SIZE},
        "requests": request_results(streams, t0),
    })  # fmt: skip
    short = [s.id for s in streams if s.output_tokens != s.max_tokens]
    if short:
        log.warning("%d request(s) ended short of max_tokens: %s", len(short), short[:5])
    return result


def run(args: argparse.Namespace) -> dict:
    with open(args.workload) as f:
        workload = json.load(f)
    streams = parse_streams(workload)
    options = engine_options(workload, args)
    deadline = time.monotonic() + args.timeout
    procs: list[EngineSupervisor] = []
    try:
        t_load = time.monotonic()
        engine, endpoint = start_process(engine_command(options), "engine", deadline)
        procs.append(engine)
        pids: dict[str, int | None] = {"engine": engine.pid}
        url = None
        if args.system == "kvscope-http":
            cmd = [sys.executable, "-m", "app", "serve", "--connect", endpoint, "--port", "0",
                   "--max-pending", str(max(256, 2 * len(streams))), "--log-level", "WARNING"]
            server, url = start_process(cmd, "HTTP server", deadline, http=True)
            procs.append(server)
            pids["server"] = server.pid
        load_s = time.monotonic() - t_load
        result = asyncio.run(measure(args.system, workload, streams, endpoint, url, pids,
                                     deadline))
    finally:
        for p in reversed(procs):  # the server first: it is the engine's client
            p.stop()
    return result | {"load_s": load_s, "engine_command": engine_command(options)[1:]}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m app.bench.clients",
                                 description="Run one front-end system on one workload; print "
                                 "one JSON line.")
    ap.add_argument("--system", required=True, choices=CLIENT_SYSTEMS)
    ap.add_argument("--workload", required=True, help="workload JSON file (app.bench writes it)")
    ap.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2)")
    ap.add_argument("--dtype", default="float32", choices=DTYPES)
    ap.add_argument("--device", default=None, help="engine device (default: the engine's auto)")
    ap.add_argument("--threads", type=int, default=None, help="the engine's torch threads")
    ap.add_argument("--kv-blocks", type=int, default=None,
                    help="KV pool size (default: every request at full length fits)")
    ap.add_argument("--decode-weights", default="dense", choices=("dense", "int4", "auto"),
                    help="the engine's decode weights (auto: 4-bit and the fused decode step)")
    ap.add_argument("--engine-args", default="", help="more `engine_proc serve` options (tests: "
                    "'--engine-factory tests.ipc.engines:tiny')")
    ap.add_argument("--timeout", type=float, default=1800.0,
                    help="seconds for the whole run, engine start-up included")
    ap.add_argument("--log-level", default="WARNING")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.system == "kvscope-http":
        import importlib.util

        if importlib.util.find_spec("httpx") is None:
            print(json.dumps(run_header(args) | {"skipped": "httpx is not installed (pip install "
                                                  "httpx)"}))  # fmt: skip
            return 0
    return run_and_report(args, run)


def run_header(args: argparse.Namespace) -> dict:
    return {"system": args.system, "dtype": args.dtype, "pid": os.getpid(),
            "workload": os.path.splitext(os.path.basename(args.workload))[0]}


def run_and_report(args: argparse.Namespace, run_one: Callable[[argparse.Namespace], dict]) -> int:
    """A worker's CLI: run, then one JSON line on stdout (the result, or the run's error)."""
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    start = time.monotonic()
    header = run_header(args)
    try:
        result = run_one(args)
    except Exception as exc:  # noqa: BLE001 - a CLI: report any failure as the run's error
        log.debug("run failed", exc_info=True)
        exc_text = f"{type(exc).__name__}: {exc}"
        print(f"error: {exc_text}", file=sys.stderr)
        print(json.dumps(header | {"error": exc_text}))
        return 1
    print(json.dumps(header | result | {"process_s": time.monotonic() - start}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
