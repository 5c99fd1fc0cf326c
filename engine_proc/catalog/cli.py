"""`python -m engine_proc models [--json] [--dir PATH ...] [--context N] [--kv-cache-dtype T]
[--dtype D] [--resolve NAME]`: the models on this machine, what the engine makes of each, and a
memory estimate; `--resolve` prints the path of one model picked by name (exit 2 with the
candidates when the name is unknown or ambiguous). The desktop app runs this as a subprocess
(it imports no engine code): `kvscope models`, the Models dialog, names given to `--model`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engine_proc.catalog.estimate import DTYPE_BYTES, available_memory, estimate
from engine_proc.catalog.inspect import ModelEntry, inspect
from engine_proc.catalog.stores import builtin, discover
from engine_proc.core.kv_sizing import KV_CACHE_DTYPES

MAX_LISTED = 20  # candidates named in a resolution error


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--dir", action="append", default=[], metavar="PATH",
                   help="also search this folder (or .gguf file); repeatable")  # fmt: skip
    p.add_argument(
        "--context",
        type=int,
        default=None,
        metavar="N",
        help="tokens of context for the memory estimate (default: each model's own)",
    )
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    p.add_argument("--dtype", default="float32", choices=tuple(DTYPE_BYTES),
                   help="the model dtype the engine would load the weights in")  # fmt: skip
    p.add_argument(
        "--resolve",
        default=None,
        metavar="NAME",
        help="print the path of the model listed under this name and exit",
    )


def catalog(dirs: list[str], context: int | None, kv_cache_dtype: str, dtype: str
            ) -> tuple[list[ModelEntry], list[dict]]:  # fmt: skip
    """The entries and, per entry, its JSON with an "estimate" (None when unsupported)."""
    free = available_memory()
    found = discover([Path(d) for d in dirs])
    paths = {f.path.resolve() for f in found}
    found = [f for f in builtin() if f.path.resolve() not in paths] + found
    entries = [inspect(f) for f in found]
    rows = []
    for e in entries:
        row = e.to_json()
        est = None
        if e.config is not None:
            est = estimate(e.config, e.params, context, kv_cache_dtype, dtype, available=free)
            est = est.to_json()
        row["estimate"] = est
        rows.append(row)
    return entries, rows


def resolve(name: str, entries: list[ModelEntry]) -> ModelEntry:
    """The entry listed as `name`: an exact name (any case), else the one whose name ends with
    it or contains it; ValueError naming the candidates when none or several match."""
    key = name.strip().lower()
    if not key:
        raise ValueError("model name must not be empty")
    for test in (lambda n: n == key, lambda n: n.endswith(key) or Path(n).stem == key,
                 lambda n: key in n):  # fmt: skip
        hits = [e for e in entries if test(e.name.lower())]
        if len(hits) == 1:
            return hits[0]
        if hits:
            listed = ", ".join(f"{e.name} ({e.store})" for e in hits[:MAX_LISTED])
            raise ValueError(f"model name {name!r} is ambiguous: it matches {len(hits)} models: "
                             f"{listed}; give a longer name or the path")  # fmt: skip
    names = ", ".join(e.name for e in entries[:MAX_LISTED]) or "none found"
    more = f" (and {len(entries) - MAX_LISTED} more)" if len(entries) > MAX_LISTED else ""
    raise ValueError(f"model {name!r} is neither a path nor a listed model; listed: {names}{more} "
                     "(`kvscope models` lists them)")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    try:
        entries, rows = catalog(args.dir, args.context, args.kv_cache_dtype, args.dtype)
        if args.resolve is not None:
            entry = resolve(args.resolve, entries)
            if args.json:
                print(
                    json.dumps(
                        {
                            "name": entry.name,
                            "path": entry.path,
                            "supported": entry.supported,
                            "reason": entry.reason,
                        }
                    )
                )
            else:
                print(entry.path)
            return 0
    except ValueError as exc:
        if args.json:
            print(json.dumps({"error": str(exc)}))
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"models": rows, "available_bytes": available_memory(),
                          "kv_cache_dtype": args.kv_cache_dtype, "dtype": args.dtype,
                          "context": args.context}))  # fmt: skip
    else:
        print(table(rows))
    return 0


COLUMNS = ("name", "store", "format", "arch", "params", "quant", "size", "ctx", "KV/token",
           "need", "fit")  # fmt: skip


def table(rows: list[dict]) -> str:
    """A plain-text table; unsupported models show their reason under the row."""
    lines = [list(COLUMNS)]
    reasons: dict[int, str] = {}
    for row in rows:
        est = row.get("estimate") or {}
        lines.append([
            row["name"], row["store"], row["format"], row["architecture"] or "?",
            human_count(row["params"]), row["quantization"] or "?", human_bytes(row["file_size"]),
            str(row["context_length"] or "?"),
            human_bytes(est["kv_bytes_per_token"]) if est else "",
            human_bytes(est["total_bytes"]) if est else "",
            est.get("fit", "") if est else "unsupported",
        ])  # fmt: skip
        if not row["supported"]:
            reasons[len(lines) - 1] = row["reason"]
    widths = [max(len(line[i]) for line in lines) for i in range(len(COLUMNS))]
    out = []
    for i, line in enumerate(lines):
        out.append("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip())
        if i in reasons:
            out.append(f"    refused: {reasons[i]}")
    if len(lines) == 1:
        out.append("(no models found; add a folder with --dir)")
    return "\n".join(out)


def human_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def human_count(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine_proc models", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))
