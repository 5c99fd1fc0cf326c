"""How many threads the window's engine should decode with (issue 35): `python -m
app.bench.window_threads [--threads 1 2] [--repeats 2] [--load 16] [--tokens 128]`.

Each run is the real app, `python -m app --measure-latency S --load N --measure-reply TOKENS
--engine-args "--num-threads T"` (offscreen, or under xvfb-run when there is no display and it
is installed), with a fresh data directory. It prints, per thread count: a greedy chat reply's
tok/s alone and under the load chats, the load generator's throughput, and the GUI event loop's
p99 latency during each (the delay a click or key press sees). Thread counts alternate across
repeats so drift hits each alike; the table gives each figure's median and its ratio to the
first thread count's. The engine runs niced, as the app always starts it."""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

REPLY = re.compile(r"(reply alone|reply under load \d+): (\S+) tokens at ([\d.]+) tok/s .*?"
                   r"p99 ([\d.]+) ms")  # fmt: skip
LOAD_P99 = re.compile(r"under load: samples \d+ +p50 [\d.]+ ms +p90 [\d.]+ ms +p99 ([\d.]+) ms")
LOAD_TPS = re.compile(r"load chats: ([\d.]+) tok/s")


def run_once(threads: int, args: argparse.Namespace) -> dict[str, float]:
    cmd = [sys.executable, "-m", "app", "--measure-latency", str(args.seconds), "--load",
           str(args.load), "--measure-reply", str(args.tokens), "--timeout", "600",
           "--engine-args", f"--num-threads {threads}"]  # fmt: skip
    env = dict(os.environ)
    if not env.get("DISPLAY") and not env.get("WAYLAND_DISPLAY"):
        if args.xvfb and _have("xvfb-run"):
            cmd = ["xvfb-run", "-a", "-s", "-screen 0 1600x1000x24", *cmd]
        else:
            env["QT_QPA_PLATFORM"] = "offscreen"
    with tempfile.TemporaryDirectory(prefix="kvscope-threads-") as data:
        env["KVSCOPE_DATA_DIR"] = data
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    text = out.stdout + out.stderr
    if args.verbose:
        print(text)
    row: dict[str, float] = {}
    for label, _n, tok_s, p99 in REPLY.findall(text):
        key = "alone" if label == "reply alone" else "loaded"
        row[f"{key}_tok_s"], row[f"{key}_p99"] = float(tok_s), float(p99)
    if m := LOAD_P99.search(text):
        row["load_p99"] = float(m.group(1))
    if m := LOAD_TPS.search(text):
        row["load_tok_s"] = float(m.group(1))
    if "alone_tok_s" not in row:
        tail = "\n".join(text.splitlines()[-15:])
        raise RuntimeError(f"the run with {threads} threads gave no reply figures:\n{tail}")
    return row


def _have(program: str) -> bool:
    return any(os.access(os.path.join(d, program), os.X_OK)
               for d in os.environ.get("PATH", "").split(os.pathsep))  # fmt: skip


COLUMNS = (("alone_tok_s", "reply alone tok/s"), ("alone_p99", "GUI p99 ms (alone)"),
           ("loaded_tok_s", "reply under load tok/s"), ("loaded_p99", "GUI p99 ms (load)"),
           ("load_tok_s", "load chats tok/s"),
           ("load_p99", "GUI p99 ms (load, window)"))  # fmt: skip


def table(results: dict[int, list[dict[str, float]]]) -> str:
    base = min(results)
    med = {t: {k: statistics.median(r[k] for r in rows if k in r) for k, _ in COLUMNS
               if any(k in r for r in rows)} for t, rows in results.items()}  # fmt: skip
    lines = ["| engine threads | " + " | ".join(label for _, label in COLUMNS) + " |",
             "|---" * (len(COLUMNS) + 1) + "|"]  # fmt: skip
    for t, m in med.items():
        cells = []
        for key, _ in COLUMNS:
            if key not in m:
                cells.append("n/a")
                continue
            ratio = "" if t == base or not med[base].get(key) else \
                f" ({m[key] / med[base][key]:.2f}x)"  # fmt: skip
            cells.append(f"{m[key]:.1f}{ratio}")
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m app.bench.window_threads")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--load", type=int, default=16, help="load chats beside the reply")
    ap.add_argument("--tokens", type=int, default=128, help="the timed reply's max tokens")
    ap.add_argument("--seconds", type=float, default=10.0, help="event-loop window under load")
    ap.add_argument("--no-xvfb", dest="xvfb", action="store_false",
                    help="offscreen Qt even where xvfb-run is installed")  # fmt: skip
    ap.add_argument("--verbose", action="store_true", help="print each run's output")
    args = ap.parse_args(argv)
    if any(t < 1 for t in args.threads):
        ap.error("--threads: each must be >= 1")
    results: dict[int, list[dict[str, float]]] = {t: [] for t in args.threads}
    for rep in range(args.repeats):
        order = args.threads if rep % 2 == 0 else list(reversed(args.threads))
        for t in order:
            print(f"repeat {rep + 1}/{args.repeats}: {t} engine thread(s)…", flush=True)
            results[t].append(run_once(t, args))
            print(f"  {results[t][-1]}", flush=True)
    print(f"\nmedians of {args.repeats} (ratios against {min(args.threads)} thread(s)); "
          f"{os.cpu_count()} logical CPUs")  # fmt: skip
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
