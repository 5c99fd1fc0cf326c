"""The block map's detail pane: a selected request's block tables (logical -> physical, per
KV group), the slots its last speculative step drafted and rolled back, and what its grammar
allowed, as monospaced text."""

from __future__ import annotations

from ui.kv.constraints import allowed_tokens_lines
from ui.kv.spec_marks import spec_lines, table_strips
from ui.telemetry import BLOCK_CACHED, BLOCK_EMPTY, BLOCK_IN_USE, Frame, RequestView

STATE_NAMES = {BLOCK_EMPTY: "empty", BLOCK_CACHED: "cached (evictable)", BLOCK_IN_USE: "in use"}
SHORT_STATE_NAMES = {BLOCK_EMPTY: "empty", BLOCK_CACHED: "cached", BLOCK_IN_USE: "in use"}


def detail_text(
    f: Frame,
    rid: str,
    live: RequestView | None,
    remembered_table: list[int],
    still_cached: set[int],
    vocab_size: int,
) -> str:
    """`live`: the request in this frame (None once finished: then the blocks of its
    remembered table that still hold its prefix, `still_cached`)."""
    if live is not None:
        table, title = live.block_table, f"{rid} ({live.status})"
    else:
        # in block-table order (a table holds each block once)
        table = [b for b in remembered_table if b in still_cached]
        title = f"{rid} (finished: {len(table)} blocks still cached)"
    # speculation first: a long table would push it out of the pane's view
    spec = spec_lines(live, f.block_size) if live is not None else []
    lines = [title, *spec, "logical→physical  fill  ref  hash      state"]
    groups = live.group_tables if live is not None else []
    if groups:
        lines.insert(1 + len(spec), "full-attention layers")
    elif any(b < 0 for b in table):  # every layer slides (Mistral): one table releases blocks
        released = sum(1 for b in table if b < 0)
        lines.insert(1 + len(spec), f"sliding-window layers: {released} blocks released "
                                    "(left the window)")  # fmt: skip
    lines += table_lines(f, table, table_strips(live, f.block_size))
    for g, group_table in enumerate(groups, 1):
        released = sum(1 for b in group_table if b < 0)
        lines.append(f"sliding-window group {g}: {released} blocks released (left the window)")
        lines += table_lines(f, group_table)
    if live is not None:
        lines += allowed_tokens_lines(live, vocab_size)
    return "\n".join(lines)


def state_name(f: Frame, b: int, names: dict[int, str]) -> str:
    if f.state[b] == BLOCK_IN_USE and f.ref_count[b] > 1:
        return "shared"
    return names.get(int(f.state[b]), "?")


def table_lines(f: Frame, table: list[int], strips: dict[int, str] | None = None) -> list[str]:
    """A line per block; `strips`: a slot strip after the blocks a speculative step drafted to."""
    strips = strips or {}
    lines = []
    for i, b in enumerate(table):
        if 0 <= b < f.num_blocks:
            st = state_name(f, b, SHORT_STATE_NAMES)
            line = (f"{i:5d} → {b:<8d}  {int(f.filled[b]):>2d}/{f.block_size:<2d}"
                    f" {int(f.ref_count[b]):>3d}  {int(f.short_hash[b]):08x}  {st:<6s}"
                    f"  {strips.get(b, '')}")
            lines.append(line.rstrip())
    return lines
