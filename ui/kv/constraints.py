"""What a request's constraint did, for the request table and its detail pane.

Requests from agents carry a grammar (`response_format`, `structured_outputs`, a forced
`tool_choice`) or tools; the engine reports, per request, the constraint's kind and how many
vocabulary tokens the grammar allowed at each of its recent steps (ipc RequestState
`structured`, `num_tools`, `allowed_tokens`). A count of 1 is a step the grammar decided alone
(a forced token: `{"`, a key, a closing brace); the vocabulary size is a step it left free.
"""

from __future__ import annotations

from ui.telemetry import RequestView

SPARK = " ▁▂▃▄▅▆▇█"
MAX_SHOWN_STEPS = 96  # counts printed in the detail pane (most recent)


def constraint_label(r: RequestView) -> str:
    """The table's short mark: the grammar's kind, "tools", both, or "" for neither."""
    parts = []
    if r.structured:
        parts.append(r.structured)
    if r.num_tools:
        parts.append(f"tools {r.num_tools}")
    return " + ".join(parts)


def constraint_tooltip(r: RequestView) -> str:
    if not (r.structured or r.num_tools):
        return "no grammar, no tools: every token allowed"
    lines = []
    if r.structured:
        lines.append(f"output constrained by a {r.structured} grammar")
    if r.num_tools:
        lines.append(f"{r.num_tools} tool{'s' if r.num_tools != 1 else ''} offered to the model")
    return "\n".join(lines)


def sparkline(counts: list[int], vocab_size: int) -> str:
    """One character per step: the share of the vocabulary allowed, on a log scale (1 token is
    the lowest bar, the whole vocabulary the highest)."""
    import math

    top = math.log(max(vocab_size, 2))
    out = []
    for c in counts:
        share = math.log(max(c, 1)) / top if top > 0 else 0.0
        out.append(SPARK[1 + min(len(SPARK) - 2, int(share * (len(SPARK) - 2) + 0.5))])
    return "".join(out)


def allowed_tokens_lines(r: RequestView, vocab_size: int) -> list[str]:
    """The detail pane's lines about the grammar: forced steps, the median allowed, the
    recent counts (oldest first) and their sparkline."""
    if not r.structured:
        return []
    counts = r.allowed_tokens
    head = f"grammar ({r.structured}): tokens allowed at each step"
    if vocab_size:
        head += f" (vocabulary {vocab_size:,})"
    if not counts:
        return [head, "  (no step decoded under it yet)"]
    forced = sum(1 for c in counts if c == 1)
    ordered = sorted(counts)
    median = ordered[len(ordered) // 2]
    shown = counts[-MAX_SHOWN_STEPS:]
    lines = [
        head,
        f"  last {len(counts)} steps: {forced} forced (one token allowed), median {median:,} "
        f"allowed, fewest {ordered[0]:,}, most {ordered[-1]:,}",
        "  " + sparkline(shown, vocab_size or max(counts)),
    ]
    row: list[str] = []
    for c in shown:
        row.append(str(c))
        if len(row) == 16:
            lines.append("  " + " ".join(row))
            row = []
    if row:
        lines.append("  " + " ".join(row))
    return lines
